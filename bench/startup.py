"""Start-up: ``neuron generate`` wall time, ``neuron serve`` until ``/ready`` and from SIGTERM to its exit, and the
CPU time each run's processes took (user + system, the leader's and its workers'), TP=1 and TP=2, this tree against
another (``--baseline``: a checkout or ``git archive`` of another commit), runs alternating.

Run: .venv/bin/python bench/startup.py --baseline /tmp/base [--pairs 6]. Each tree runs from this venv with
``PYTHONPATH`` naming it, from a scratch folder (so that neither tree's folder is on ``sys.path`` by accident); the
workers inherit it. The tiny model is the tests' (``testkit.make_tiny_model``). For quiet figures on a shared machine
run it at top priority: ``setsid sh -c 'echo -20 > /proc/$$/autogroup; exec .venv/bin/python bench/startup.py ...'``.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.models import make_tiny_model  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children_cpu() -> float:
    """CPU seconds of the children reaped so far (a worker counts once its leader has reaped it)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def generate(tree: str, model: Path, tp: int, scratch: str) -> dict[str, float]:
    cpu = children_cpu()
    started = time.perf_counter()
    command = [sys.executable, "-m", "neuron", "generate", "--model", str(model), "--tp", str(tp)]
    done = subprocess.run(
        [*command, "--max-tokens", "4", "hello"],
        env={**os.environ, "PYTHONPATH": tree},
        cwd=scratch,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"neuron generate --tp {tp} from {tree} exited {done.returncode}: {done.stderr[-2000:]}")
    return {"generate": time.perf_counter() - started, "generate CPU": children_cpu() - cpu}


def serve(tree: str, model: Path, tp: int, scratch: str) -> dict[str, float]:
    port = free_port()
    cpu = children_cpu()
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "neuron", "serve", "--model", str(model), "--tp", str(tp), "--port", str(port)],
        env={**os.environ, "PYTHONPATH": tree},
        cwd=scratch,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # its log; a failure to start says itself by its exit
    )
    try:
        ready = None
        while ready is None and time.perf_counter() - started < 120:
            if process.poll() is not None:
                raise SystemExit(f"neuron serve --tp {tp} from {tree} exited {process.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as reply:
                    if reply.status == 200:
                        ready = time.perf_counter() - started
            except OSError:
                time.sleep(0.01)
        if ready is None:
            raise SystemExit(f"neuron serve --tp {tp} from {tree} not ready within 120 s")
    finally:
        stopping = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    stopped = time.perf_counter() - stopping
    return {"serve to ready": ready, "serve SIGTERM to exit": stopped, "serve CPU": children_cpu() - cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="another tree of neuron (its folder holds neuron/)")
    parser.add_argument("--pairs", type=int, default=6)
    args = parser.parse_args()
    trees = {"baseline": str(Path(args.baseline).resolve()), "this": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="neuron-startup-") as scratch:
        model = make_tiny_model(Path(scratch) / "tiny", "llama")
        times: dict[tuple[str, int, str], list[float]] = {}
        for _ in range(args.pairs):
            for run in (generate, serve):
                for tp in (1, 2):
                    for name, tree in trees.items():
                        for what, seconds in run(tree, model, tp, scratch).items():
                            times.setdefault((what, tp, name), []).append(seconds)
    print(f"| command | baseline s | this s | this / baseline |  ({args.pairs} alternating pairs, medians)")
    print("|---|---|---|---|")
    for what in ("generate", "generate CPU", "serve to ready", "serve SIGTERM to exit", "serve CPU"):
        for tp in (1, 2):
            before = statistics.median(times[(what, tp, "baseline")])
            after = statistics.median(times[(what, tp, "this")])
            command, _, measure = what.partition(" ")
            print(f"| `{command} --tp {tp}` {measure} | {before:.2f} | {after:.2f} | {after / before:.2f}x |")


if __name__ == "__main__":
    main()
