"""Start-up: ``neuron generate`` wall time and ``neuron serve`` until ``/ready``, TP=1 and TP=2, this tree against
another (``--baseline``: a checkout or ``git archive`` of another commit), runs alternating.

Run: .venv/bin/python bench/startup.py --baseline /tmp/base [--pairs 6]. Each tree runs from this venv with
``PYTHONPATH`` naming it, from a scratch folder (so that neither tree's folder is on ``sys.path`` by accident); the
workers inherit it. The tiny model is the tests' (``testkit.make_tiny_model``). For quiet figures on a shared machine
run it at top priority: ``setsid sh -c 'echo -20 > /proc/$$/autogroup; exec .venv/bin/python bench/startup.py ...'``.
"""

from __future__ import annotations

import argparse
import os
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


def generate(tree: str, model: Path, tp: int, scratch: str) -> float:
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
    return time.perf_counter() - started


def serve_to_ready(tree: str, model: Path, tp: int, scratch: str) -> float:
    port = free_port()
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "neuron", "serve", "--model", str(model), "--tp", str(tp), "--port", str(port)],
        env={**os.environ, "PYTHONPATH": tree},
        cwd=scratch,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # its log; a failure to start says itself by its exit
    )
    try:
        while time.perf_counter() - started < 120:
            if process.poll() is not None:
                raise SystemExit(f"neuron serve --tp {tp} from {tree} exited {process.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return time.perf_counter() - started
            except OSError:
                time.sleep(0.01)
        raise SystemExit(f"neuron serve --tp {tp} from {tree} not ready within 120 s")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


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
            for what, run in (("generate", generate), ("serve to ready", serve_to_ready)):
                for tp in (1, 2):
                    for name, tree in trees.items():
                        times.setdefault((what, tp, name), []).append(run(tree, model, tp, scratch))
    print(f"| command | baseline s | this s | this / baseline |  ({args.pairs} alternating pairs, medians)")
    print("|---|---|---|---|")
    for what in ("generate", "serve to ready"):
        for tp in (1, 2):
            before = statistics.median(times[(what, tp, "baseline")])
            after = statistics.median(times[(what, tp, "this")])
            print(f"| {what} --tp {tp} | {before:.2f} | {after:.2f} | {after / before:.2f}x |")


if __name__ == "__main__":
    main()
