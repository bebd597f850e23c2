"""Requests that outlive a lost rank: the time from the kill to the next token of each resumed stream.

Run: .venv/bin/python bench/resume.py [--trials 3] [--hosts] [--spare] [--shrink]
(--hosts, --spare, --shrink: as root, with openssh-server and iproute2)

A TP=2 server of the tiny qwen3 (testkit's, random weights, a real tokenizer) streams testkit/resume.py's four
requests (two greedy, two seeded, 300 tokens each; 60 across hosts, where a step is slower); once every stream
has a few chunks, rank 1's worker is SIGKILLed. Each stream must then end as the same request did on the
undisturbed server (its text equal, no error event), and for each the time from the kill to its first token
after it is taken. One host: the worker is a local process. ``--hosts``: rank 1 runs on a namespace host of
testkit/testbed.py, started over SSH, and the fault is killing its SSH session. The server logs its own part
(``recovered``: loss noticed to the group probed again); the rest is the replay of each stream (its prompt and
output fed again, one blamed stream per step).

``--spare``: the host that runs rank 1 dies for good (its link down, every process in its namespace killed), and
rank 1 moves to the hostfile's spare once the host has been out of reach for ``--spare-timeout``; the dead host then
comes back, a spare in turn, and the next trial kills the other. Its table gives each part of the time from the
death to each stream's next token, from the leader's log: detect (to ``recovering``: the step deadline runs out),
out of reach (to ``rank moved to a spare``: the rest of ``--spare-timeout``, with the tries to reach the host),
start the spare (to ``workers started``: a worker over SSH on the spare, pinged), re-form, load, probe (the group
formed, the model loaded on every rank, a probe step: ``recovered``), and replay (to each stream's next token).

``--shrink``: three pipeline stages over the leader and two hosts with no spare; the last host dies for good, and
once it has been out of reach for ``--spare-timeout`` the group goes on as two stages (``group shrunk``), a fresh
server each trial. The same parts, the workers started being the smaller group's.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuron.config.settings import default
from testkit import Server, make_tiny_model
from testkit.resume import disturb, kill, reference, shorter, worker_pid
from testkit.testbed import Namespaces, children


def trials(server: Server, count: int, across: bool, tokens: int) -> tuple[list[float], list[float]]:
    """Seconds from each kill to each stream's next token, and the server's own recovery times."""
    bases = shorter(tokens)
    references = [reference(server.url, base) for base in bases]
    to_next = []
    for _ in range(count):
        victim = children(server.process.pid, "ssh")[0] if across else worker_pid(server)
        streams, at = disturb(server, references, kill(victim, signal.SIGKILL), bases=bases)
        to_next += [t for s in streams if (t := s.first_after(at)) is not None]
    recoveries = [e["ms"] / 1000 for e in server.logs() if e.get("event") == "recovered" and e.get("in_process")]
    return to_next, recoveries


def report(name: str, to_next: list[float], recoveries: list[float]) -> None:
    print(
        f"| {name} | {len(to_next)} | {statistics.median(to_next):.2f} | {max(to_next):.2f} | "
        f"{statistics.median(recoveries):.2f} |"
    )


def wall(entry: dict) -> float:
    return datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()


def death_trials(server: Server, bed: Namespaces, hosts: list[int], tokens: int, event: str) -> dict[str, list[float]]:
    """Each part of the time from a host's death (each of ``hosts`` in turn, brought back after) to each stream's
    next token, the group taking its new shape at the leader's log ``event``."""
    bases = shorter(tokens)
    references = [reference(server.url, base) for base in bases]
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    for host in hosts:
        seen = len(server.logs())
        died: list[float] = []
        streams, at = disturb(server, references, dying(bed, host, died), bases=bases)
        bed.back(host)  # a spare again, for the next trial's move
        for name, seconds in zip(PARTS, itertools.pairwise(marks(server.logs()[seen:], died[0], event)), strict=False):
            parts[name].append(seconds[1] - seconds[0])
        recovered = at + parts["detect"][-1] + sum(parts[name][-1] for name in PARTS[1:4])  # on the streams' clock
        parts["replay"] += [t for s in streams if (t := s.first_after(recovered)) is not None]
        parts["death → next token"] += [t for s in streams if (t := s.first_after(at)) is not None]
    return parts


def dying(bed: Namespaces, host: int, died: list[float]) -> Callable[[], None]:
    """The fault: ``host`` dies for good, its moment (the leader's log's clock) noted in ``died``."""

    def die() -> None:
        died.append(time.time())
        bed.gone_for_good(host)

    return die


def marks(logs: list[dict], died: float, event: str) -> list[float]:
    """When the host died, the loss was noticed, the group took its new shape (``event``: a rank moved, the group
    shrank), its workers started, and it was back, from the leader's log entries since."""

    def first(name: str, after: float = died) -> float:
        return next(t for e in logs if e.get("event") == name and (t := wall(e)) >= after)

    reshaped = first(event)
    return [died, first("recovering"), reshaped, first("workers started", reshaped), first("recovered", reshaped)]


PARTS = ["detect", "out of reach", "start the workers", "re-form, load, probe", "replay", "death → next token"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--hosts", action="store_true", help="also across namespace hosts (root)")
    parser.add_argument("--tokens", type=int, default=300, help="tokens per request on one host")
    parser.add_argument("--hosts-tokens", type=int, default=60, help="tokens per request across hosts")
    parser.add_argument("--spare", action="store_true", help="only a host's death and the move to a spare (root)")
    parser.add_argument("--shrink", action="store_true", help="only a host's death with no spare: PP=3 to 2 (root)")
    parser.add_argument("--spare-timeout", type=float, default=default("spare_timeout"))
    args = parser.parse_args()
    if args.spare:
        spare(args)
        return
    if args.shrink:
        shrink(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "qwen3", "qwen3")
        print("| ranks | streams resumed | kill → next token, p50 (s) | max (s) | recovery logged, p50 (s) |")
        print("|---|---|---|---|---|")
        server = Server("--model", str(model), "--tp", "2", "--step-timeout", "3", log_path=root / "local.log")
        try:
            report("TP=2, one host (SIGKILL a worker)", *trials(server.start(), args.trials, False, args.tokens))
        finally:
            server.stop()
        if args.hosts:
            (root / "bed").mkdir()
            bed = Namespaces(1, root / "bed")
            try:
                bed.start()
                hostfile = bed.hostfile([bed.entry(-1), bed.entry(0)], "bench.json")
                hosts = ("--hosts", str(hostfile), "--ssh-command", bed.ssh_command)
                server = Server("--model", str(model), "--step-timeout", "3", *hosts, log_path=root / "hosts.log")
                try:
                    found = trials(server.start(), args.trials, True, args.hosts_tokens)
                    report("TP=2, two hosts (SIGKILL the SSH session)", *found)
                finally:
                    server.stop()
            finally:
                bed.close()


def across(root: Path, bed: Namespaces, args: argparse.Namespace, hostfile: Path, *more: str) -> Server:
    """A server of the tiny model over ``hostfile``'s hosts, with the deadlines a host's death is measured under."""
    return Server(
        *("--model", str(root / "qwen3"), "--hosts", str(hostfile), "--ssh-command", bed.ssh_command, *more),
        *("--step-timeout", "3", "--spare-timeout", str(args.spare_timeout), "--resume-timeout", "120"),
        log_path=hostfile.with_suffix(".log"),
    )


@contextmanager
def two_hosts() -> Iterator[tuple[Path, Namespaces]]:
    """A folder holding the tiny model, and a bed of two namespace hosts, removed after."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_tiny_model(root / "qwen3", "qwen3")
        bed = Namespaces(2, root)
        try:
            yield root, bed.start()
        finally:
            bed.close()


def spare(args: argparse.Namespace) -> None:
    with two_hosts() as (root, bed):
        server = across(root, bed, args, bed.hostfile([bed.entry(-1), bed.entry(0)], "spare.json", [bed.entry(1)]))
        try:
            # Rank 1's host: host 0 first, then the spare it moved to (host 1), and so on.
            hosts = [trial % 2 for trial in range(args.trials)]
            parts = death_trials(server.start(), bed, hosts, args.hosts_tokens, "rank moved to a spare")
        finally:
            server.stop()
    table(f"TP=2 over two hosts and a spare, --step-timeout 3, --spare-timeout {args.spare_timeout:g}, {args.trials} "
          f"moves, {len(parts['replay'])} streams; seconds, median (max):", parts)  # fmt: skip


def shrink(args: argparse.Namespace) -> None:
    """Three pipeline stages over the leader and two hosts, no spare: the last host dies for good, and the group
    goes on as two stages. A fresh server each trial (a group of three shrinks once)."""
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    with two_hosts() as (root, bed):
        for trial in range(args.trials):
            hostfile = bed.hostfile([bed.entry(-1), bed.entry(0), bed.entry(1)], f"shrink{trial}.json")
            server = across(root, bed, args, hostfile, "--pp", "3")
            try:
                found = death_trials(server.start(), bed, [1], args.hosts_tokens, "group shrunk")
            finally:
                server.stop()
            for name, seconds in found.items():
                parts[name] += seconds
    title = (
        f"PP=3 over the leader and two hosts, no spare, shrunk to PP=2, --step-timeout 3, --spare-timeout "
        f"{args.spare_timeout:g}, {args.trials} trials, {len(parts['replay'])} streams; seconds, median (max):"
    )
    table(title, parts)


def table(title: str, parts: dict[str, list[float]]) -> None:
    print(title)
    print("| " + " | ".join(PARTS) + " |")
    print("|" + "---|" * len(PARTS))
    print("| " + " | ".join(f"{statistics.median(v):.2f} ({max(v):.2f})" for v in parts.values()) + " |")


if __name__ == "__main__":
    main()
