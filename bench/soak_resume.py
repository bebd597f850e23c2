"""A soak of random faults against streams on the two-host test bed: every stream must end as on an undisturbed
server (or be refused with a clear error once blamed too often), the leader must never restart, and no worker may
be left behind.

Run (as root, with openssh-server and iproute2):
    .venv/bin/python bench/soak_resume.py --minutes 30 [--data-plane ssh] \\
        [--faults kill,stop,ssh,link,tunnel,gone,added]

A TP=2 server of the tiny qwen3 runs rank 0 in the leader (the root namespace) and rank 1 on one of two namespace
hosts of testkit/testbed.py, started over SSH; the other host is its spare (``--spare-timeout``). Each round streams
eight requests (greedy and seeded, ``ignore_eos``) and, once every stream has a few chunks, lands one fault, drawn at
random, on the host that holds rank 1: the worker SIGKILLed (``kill``), SIGSTOPped past the step deadline
(``stop``), its SSH session killed (``ssh``), the host's link taken down until a recovery try fails and then brought
back (``link``), or, with ``--data-plane ssh``, the tunnel connection killed (``tunnel``); the host gone for good,
every process in its namespace killed and its link down, so that rank 1 moves to the spare, the lost host booted
again once the streams ended, a spare once more (``gone``); or the host drained with ``neuron hosts drain``, rank 1
moving to the spare, then added back as a spare with ``neuron hosts add`` once the streams ended (``added``).
Prints a markdown table of rounds per fault: the time from the fault to each stream's next token, and the rounds
that failed, with why.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testkit import Server, alive, make_tiny_model, run_neuron, wait_until
from testkit.resume import BODIES, Stream, join, reference, start_streams
from testkit.testbed import Namespaces, children

STEP_TIMEOUT_S = 3
# Past a link fault's first failed recovery try, so that only a host gone for good moves; well under
# --resume-timeout.
SPARE_S = 15
HOSTS = 2  # the working host and its spare
TOKENS = 100  # far more than a fault's few chunks: every stream is mid-way when it lands
# Eight streams: the four resume requests and four more of each kind.
EIGHT = [
    *BODIES,
    {"prompt": "Tell me a story about", "temperature": 0.0},
    {"prompt": "1, 2, 3,", "temperature": 0.0, "logprobs": 1},
    {"prompt": "The weather today", "temperature": 0.8, "seed": 3},
    {"prompt": "import numpy as np", "temperature": 1.0, "top_k": 20, "seed": 5},
]
BASES = [{**base, "max_tokens": TOKENS} for base in EIGHT]


def sessions(server: Server) -> tuple[list[int], list[int]]:
    """The leader's ssh processes: the workers' sessions, and the tunnel connections (ControlMasters)."""
    worker, tunnel = [], []
    for pid in children(server.process.pid, "ssh"):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        (tunnel if b"ControlMaster=yes" in command else worker).append(pid)
    return worker, tunnel


def working(bed: Namespaces) -> int:
    """The namespace host that holds rank 1 (the one with a worker)."""
    (host,) = [i for i in range(HOSTS) if bed.workers(i)]
    return host


def fault(name: str, bed: Namespaces, server: Server) -> Callable[[], Callable[[], None]]:
    """The fault ``name``, as a call that lands it on the host holding rank 1 and returns what undoes it once the
    streams ended."""

    def land() -> Callable[[], None]:
        host = working(bed)
        if name in ("kill", "stop"):
            (worker,) = bed.workers(host)
            os.kill(worker, signal.SIGKILL if name == "kill" else signal.SIGSTOP)
            return lambda: _cont(worker) if name == "stop" else None
        if name in ("ssh", "tunnel"):
            worker, tunnel = sessions(server)
            (pid,) = worker if name == "ssh" else tunnel
            os.kill(pid, signal.SIGKILL)
            return lambda: None
        if name == "gone":
            bed.gone_for_good(host)
            return lambda: bed.back(host)  # boots again: a spare once more
        if name == "added":
            drained = _hosts(server, "drain", f"root@{bed.ip(host)}")
            assert drained.returncode == 0, drained.stderr
            entry = bed.entry(host)
            return lambda: _add(server, entry)
        assert name == "link"
        tries = _count(server, "recovery failed; trying again")
        bed.link(host, up=False)
        try:
            wait_until(lambda: _count(server, "recovery failed; trying again") > tries, 90, "a recovery try failing")
        finally:
            bed.link(host, up=True)
        return lambda: None

    return land


def _hosts(server: Server, *words: str) -> subprocess.CompletedProcess[str]:
    return run_neuron("hosts", *words, "--url", server.url, timeout=300)


def _add(server: Server, entry: dict) -> None:
    added = _hosts(server, "add", entry["ssh"], "--ip", entry["ips"][0], "--neuron", entry["neuron"], "--cpus", "1")
    assert added.returncode == 0, added.stderr


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)  # its session is gone: it exits once it runs again
    except ProcessLookupError:
        pass


def _count(server: Server, event: str) -> int:
    return sum(1 for e in server.logs() if e.get("event") == event)


def one_round(server: Server, references: list[str], land: Callable[[], Callable[[], None]]) -> tuple[str, list[float]]:
    """Stream every request, land the fault once each has a few chunks; '' when every stream ended as it should,
    else why not; and the seconds from the fault to each stream's next token."""
    streams: list[Stream] = start_streams(server.url, BASES)
    wait_until(lambda: all(s.chunks >= 3 for s in streams), 120, "3 chunks on every stream")
    at = time.monotonic()
    undo = land()
    try:
        join(streams, 600)
    finally:
        undo()
    wrong = []
    for s, expected in zip(streams, references, strict=True):
        if s.error is not None:
            message = str(s.error.get("message") if isinstance(s.error, dict) else s.error)
            if "--resume-tries" not in message:
                wrong.append(f"{s.base['prompt']!r}: {message}")
        elif s.text != expected or (s.usage or {}).get("completion_tokens") != TOKENS:
            wrong.append(f"{s.base['prompt']!r}: text differs from the undisturbed run")
    return "; ".join(wrong), [t for s in streams if (t := s.first_after(at)) is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to keep landing faults")
    parser.add_argument("--data-plane", choices=["direct", "ssh"], default="direct")
    parser.add_argument("--faults", default="kill,stop,ssh,link,tunnel,gone,added")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = [f for f in args.faults.split(",") if f != "tunnel" or args.data_plane == "ssh"]
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "qwen3", "qwen3")
        (root / "bed").mkdir()
        bed = Namespaces(HOSTS, root / "bed").start()
        try:
            hostfile = bed.hostfile([bed.entry(-1), bed.entry(0)], "soak.json", spares=[bed.entry(1)])
            cluster = ("--hosts", str(hostfile), "--ssh-command", bed.ssh_command, "--data-plane", args.data_plane)
            serve = ("--model", str(model), "--step-timeout", str(STEP_TIMEOUT_S), "--resume-timeout", "120")
            serve = (*serve, "--spare-timeout", str(SPARE_S))
            server = Server(*serve, *cluster, log_path=root / "serve.log").start()
            failures: dict[str, list[str]] = defaultdict(list)
            to_next: dict[str, list[float]] = defaultdict(list)
            rounds: dict[str, int] = defaultdict(int)
            try:
                references = [reference(server.url, base) for base in BASES]
                pid = server.process.pid
                ends = time.monotonic() + args.minutes * 60
                while time.monotonic() < ends:
                    name = rng.choice(names)
                    rounds[name] += 1
                    started = time.monotonic()
                    wrong, times = one_round(server, references, fault(name, bed, server))
                    to_next[name] += times
                    restarted = server.find_log("restarting") or server.find_log("group lost; restarting the leader")
                    if restarted is not None or server.process.pid != pid or server.process.poll() is not None:
                        wrong += f"; the leader restarted: {restarted}"
                    # Once recovered, one worker on one host: the lost one exited.
                    wait_until(lambda: sum(len(bed.workers(i)) for i in range(HOSTS)) == 1, 60, "one worker left")
                    if wrong:
                        failures[name].append(wrong)
                    print(f"{name}: {'ok' if not wrong else wrong} ({time.monotonic() - started:.1f} s)", flush=True)
                    if restarted is not None:
                        break
            finally:
                try:
                    stopped = server.stop()
                except subprocess.TimeoutExpired:
                    stopped = -1  # killed: it did not stop within a minute of SIGTERM
            wait_until(lambda: not any(bed.workers(i) for i in range(HOSTS)), 15, "no worker left once stopped")
            assert all(not alive(p) for i in range(HOSTS) for p in bed.workers(i))
        finally:
            bed.close()
    print(f"\n{sum(rounds.values())} rounds in {args.minutes:g} min, data plane {args.data_plane}, exit {stopped}\n")
    print("| fault | rounds | failed | fault → next token, median s | max s |")
    print("|---|---|---|---|---|")
    for name in sorted(rounds):
        times = to_next[name] or [float("nan")]
        print(
            f"| {name} | {rounds[name]} | {len(failures[name])} | {statistics.median(times):.2f} | {max(times):.2f} |"
        )
    for name, why in failures.items():
        for w in why:
            print(f"- {name}: {w}")
    sys.exit(1 if any(failures.values()) or stopped != 0 else 0)


if __name__ == "__main__":
    main()
