"""Where one steady decode step's time goes in ``neuron serve``, piece by piece, in microseconds per step.

Run (as root, or where ptrace is allowed): .venv/bin/python bench/profile_step.py [--generate 256,4,4,512]
         [--tp 1 2] [--streams 1 8] [--seconds 8] [--rate 500] [--serve '--run-ahead on'] [--checkout DIR]

For each TP and stream count it starts a real ``neuron serve`` on the model
(by default the tiny generated qwen3 whose step is mostly host time), keeps that
many streamed, greedy ``/v1/completions`` clients busy, and attaches py-spy
(``--threads --idle``, so waiting shows too) to the leader and to rank 1's
worker for ``--seconds``. The server's own step counter (``/metrics``) gives the
steps in that window. Each sample is charged to one piece by the innermost frame
of its stack that says which (``piece``); a thread's share of its samples times
the window, over the steps, is that piece's microseconds per step. A thread's
rows add up to one step's wall time; the threads run side by side.

The sampler slows what it watches (it stops nothing with ``--nonblocking``, but it
takes a core of its own on a small machine): the rates shown are the server's
under the profiler, and the shares are what to read. ``--checkout DIR`` profiles
the ``neuron serve`` of another checkout (``git archive COMMIT | tar -x -C DIR``):
the same table for an earlier commit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from http_decode import PROMPT, process_cpu_seconds
from streaming import stream_completion

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (thread, piece) rules: the first whose test holds for a frame, walking the stack from its innermost frame out,
# names the piece. A frame is ``function (path:line)``.
Rule = tuple[str, str]  # (substring of the frame, piece)
LEADER_RULES: list[Rule] = [
    ("EpollSelector.select", "event loop: waiting (idle)"),
    ("neuron/server/", "HTTP and SSE (neuron.server)"),
    ("uvicorn/", "HTTP and SSE (uvicorn, starlette)"),
    ("starlette/", "HTTP and SSE (uvicorn, starlette)"),
    ("h11/", "HTTP and SSE (uvicorn, starlette)"),
    ("neuron/engine/scheduler.py", "scheduler: plan and apply"),
    ("neuron/engine/planner.py", "scheduler: plan and apply"),
    ("neuron/engine/drafts.py", "scheduler: plan and apply"),
    ("neuron/engine/prefix.py", "scheduler: plan and apply"),
    ("neuron/engine/output.py", "engine: text and events"),
    ("neuron/engine/text.py", "engine: text and events"),
    ("neuron/engine/sequence.py", "engine: text and events"),
    ("neuron/pool/fanout.py", "fan-out to workers and drain"),
    ("neuron/pool/link.py", "fan-out to workers and drain"),
    ("neuron/rpc/", "fan-out to workers and drain"),
    ("neuron/pool/rank0.py", "hand-off to rank 0's thread"),
    ("neuron/pool/pool.py", "engine loop (step, metrics, log)"),
    ("neuron/engine/", "engine loop (step, metrics, log)"),
    ("prometheus_client/", "engine loop (step, metrics, log)"),
    ("structlog/", "engine loop (step, metrics, log)"),
    ("", "event loop: task switches (asyncio, anyio)"),
]
RANK_RULES: list[Rule] = [
    ("Rank0Thread._run (", "rank 0: waiting for a job"),
    ("RunAhead.settle", "rank: forward run ahead, evaluated (settle)"),
    ("_signaller", "rank 0: waking the event loop"),
    ("call_soon_threadsafe", "rank 0: waking the event loop"),
    # Where a step waits on the device: rank 0's one read alone (TP=1), or the runner's evaluation with its
    # collectives (TP>1); the innermost Python frame of a long native call.
    ("read (neuron/rank/head/sampler.py", "rank: forward evaluated (tokens read)"),
    ("Sliced._logits (", "rank: forward evaluated (tokens read)"),
    ("_eval_with (", "rank: forward evaluated (tokens read)"),
    ("neuron/rank/head/sampler.py", "rank: step on the host (plan, graph, sampling)"),
    ("neuron/rank/", "rank: step on the host (plan, graph, sampling)"),
    ("mlx_lm/", "rank: step on the host (plan, graph, sampling)"),
    ("mlx/", "rank: step on the host (plan, graph, sampling)"),
    ("neuron/rpc/", "worker: reading the plan, writing the reply"),
    ("neuron/cli/worker.py", "worker: waiting for a plan"),
    ("", "other"),
]


def piece(frames: list[str], rules: list[Rule]) -> str:
    for frame in reversed(frames):
        for test, name in rules:
            if test and test in frame:
                return name
    return rules[-1][1]


def parse(raw: Path, leader: bool) -> dict[str, Counter[str]]:
    """py-spy's raw (collapsed) output: samples by thread name, then by piece; threads that ran nothing known (a
    reaper, a waiter on a child process) are left out."""
    threads: dict[str, Counter[str]] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or not count.isdigit():
            continue
        thread = frames[0].split(": ", 1)[-1]  # "thread (123): MainThread"
        rules = LEADER_RULES if leader and thread == "MainThread" else RANK_RULES
        threads.setdefault(thread, Counter())[piece(frames[1:], rules)] += int(count)
    return {thread: pieces for thread, pieces in threads.items() if set(pieces) != {"other"}}


def _worker_pids(leader: int) -> list[int]:
    """Rank processes started under ``leader`` (``neuron --worker``), found through /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if b"--worker" in cmdline and _descends(parent, leader):
            found.append(int(entry.name))
    return sorted(found)


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    return False


def _steps(server: object) -> tuple[float, float]:
    """Steps and completion tokens so far, from the server's metrics."""
    scraped = server.metrics()  # type: ignore[attr-defined]
    steps = sum(
        v
        for (name, labels), v in scraped.items()
        if name == "neuron_step_seconds_count" and labels == (("part", "total"),)
    )
    tokens = sum(v for (name, _), v in scraped.items() if name == "neuron_completion_tokens_total")
    return steps, tokens


def profile(
    model: str,
    served: str,
    tp: int,
    streams: int,
    seconds: float,
    rate: int,
    flags: list[str],
    scratch: Path,
    checkout: str | None,
) -> dict:
    from testkit import Server

    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy (and run as root)")
    # PYTHONSAFEPATH: ``python -m neuron`` must not import this checkout from its working directory.
    env = {"PYTHONPATH": str(Path(checkout).resolve()), "PYTHONSAFEPATH": "1"} if checkout else None
    log = scratch / f"serve-{tp}-{streams}.log"
    server = Server("--model", model, "--tp", str(tp), *flags, log_path=log, env=env).start()
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            stream_completion(server.url, served, PROMPT, 256)

    clients = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
    try:
        stream_completion(server.url, served, PROMPT, 32)  # warm
        for c in clients:
            c.start()
        time.sleep(2.0)  # every stream decoding
        pids = {
            "leader": server.process.pid,
            **{f"rank {i + 1}": p for i, p in enumerate(_worker_pids(server.process.pid))},
        }
        raws = {name: scratch / f"{name.replace(' ', '')}-{tp}-{streams}.raw" for name in pids}
        steps0, tokens0 = _steps(server)
        cpu0 = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
        began = time.perf_counter()
        spies = [
            subprocess.Popen(
                [
                    spy,
                    "record",
                    "--threads",
                    "--idle",
                    "--nonblocking",
                    "-r",
                    str(rate),
                    "-f",
                    "raw",
                    "-d",
                    str(round(seconds)),
                    "-o",
                    str(raws[name]),
                    "-p",
                    str(pid),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name, pid in pids.items()
        ]
        for s in spies:
            if s.wait(timeout=seconds + 60) != 0:
                raise SystemExit(f"py-spy failed ({s.args}); it needs root or ptrace permission")
        window = time.perf_counter() - began
        steps1, tokens1 = _steps(server)
        cpu = {name: process_cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=120)
        server.stop()
    steps = steps1 - steps0
    threads = {}
    for name, raw in raws.items():
        for thread, pieces in parse(raw, name == "leader").items():
            if sum(pieces.values()) >= 0.2 * rate * seconds:  # the threads that ran throughout, not helpers
                threads[f"{name} {thread}"] = pieces
    return {
        "steps": steps,
        "window": window,
        "tokens_per_s": (tokens1 - tokens0) / window,
        "us_per_step": window / steps * 1e6,
        "cpu_us_per_step": {name: c / steps * 1e6 for name, c in cpu.items()},
        "threads": threads,
    }


def table(results: dict[str, dict]) -> None:
    configs = list(results)
    print("| thread: piece | " + " | ".join(configs) + " |")
    print("|---|" + "---|" * len(configs))
    print(
        "| steady decode, tok/s (under the profiler) | "
        + " | ".join(f"{results[c]['tokens_per_s']:.0f}" for c in configs)
        + " |"
    )
    print("| **one step, wall µs** | " + " | ".join(f"**{results[c]['us_per_step']:.0f}**" for c in configs) + " |")
    procs = sorted({p for r in results.values() for p in r["cpu_us_per_step"]})
    for proc in procs:
        cells = [
            f"{results[c]['cpu_us_per_step'][proc]:.0f}" if proc in results[c]["cpu_us_per_step"] else ""
            for c in configs
        ]
        print(f"| {proc}: CPU µs per step (all its threads) | " + " | ".join(cells) + " |")
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for c in configs:
        r = results[c]
        for thread, pieces in r["threads"].items():
            total = sum(pieces.values())
            for name, n in pieces.items():
                rows.setdefault((thread, name), {})[c] = n / total * r["us_per_step"]
    for (thread, name), cells in sorted(rows.items(), key=lambda kv: (kv[0][0], -max(kv[1].values()))):
        if max(cells.values()) < 5:
            continue
        print(f"| {thread}: {name} | " + " | ".join(f"{cells[c]:.0f}" if c in cells else "" for c in configs) + " |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="model folder (default: a generated qwen3 of --generate's shape)")
    parser.add_argument("--generate", default="256,4,4,512", metavar="HIDDEN,LAYERS,HEADS,INTERMEDIATE")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--rate", type=int, default=500, help="samples per second per process")
    parser.add_argument("--keep", metavar="DIR", help="keep py-spy's raw output (and the servers' logs) in DIR")
    parser.add_argument("--checkout", metavar="DIR", help="profile the neuron serve of another checkout")
    parser.add_argument("--serve", default="", metavar="FLAGS", help="extra flags for neuron serve ('--run-ahead on')")
    args = parser.parse_args()

    from neuron.models.folder import model_id
    from testkit import make_tiny_model

    scratch = Path(tempfile.mkdtemp())
    kept = Path(args.keep) if args.keep else None
    try:
        model = args.model
        if model is None:
            hidden, layers, heads, intermediate = (int(x) for x in args.generate.split(","))
            model = str(make_tiny_model(scratch / "qwen3", "qwen3", 0, hidden, layers, heads, intermediate))
        load = os.getloadavg()
        results = {
            f"TP={tp}, {streams} stream{'s' if streams > 1 else ''}": profile(
                model, model_id(model), tp, streams, args.seconds, args.rate, args.serve.split(), scratch, args.checkout
            )
            for tp in args.tp
            for streams in args.streams
        }
        where = args.checkout or "this checkout"
        print(f"model {Path(model).name}, {where}, flags '{args.serve}', {args.seconds:g} s per column at {args.rate}")
        print(f"samples/s; load before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}; µs per step\n")
        table(results)
    finally:
        if kept is not None:
            kept.mkdir(parents=True, exist_ok=True)
            for found in [*scratch.glob("*.raw"), *scratch.glob("*.log")]:
                shutil.copy(found, kept / found.name)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
