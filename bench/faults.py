"""Unattended recovery, the long run: SIGKILL rank 1 of a TP=2 server at a random moment under 3 streams, N times,
with ``--resume-timeout 0`` (the leader restarts; ``bench/resume.py`` measures requests that resume instead).

Run: .venv/bin/python bench/faults.py [--trials 20] [--seed 1]
Each trial is tests/e2e/faults/test_recovery.py's: every client must get a clean
error event within 2 s of the kill, the server must be ready again with no
operator, and the next greedy completion must equal a clean run's. Prints
time-to-ready (kill to /ready 200) p50 and max, and the recovery the server
logs itself (loss noticed to ready again).
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    from testkit import Server, make_tiny_model
    from testkit.recovery import COMPLETIONS, GREEDY, kill_trial

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "qwen3", "qwen3")
        args = ("--model", str(model), "--tp", "2", "--step-timeout", "3", "--resume-timeout", "0")
        server = Server(*args, log_path=Path(tmp) / "log").start()
        try:
            reference = httpx.post(f"{server.url}{COMPLETIONS}", json=GREEDY, timeout=60).json()["choices"][0]["text"]
            rng = random.Random(args.seed)
            to_ready = [kill_trial(server, reference, rng, signal.SIGKILL, end_within=2.0) for _ in range(args.trials)]
            logged = [e["ms"] / 1000 for e in server.logs() if e.get("event") == "recovered"]
        finally:
            server.stop()
    print("| trials | kill → /ready p50 (s) | max (s) | logged recovery p50 (s) | max (s) |")
    print("|---|---|---|---|---|")
    print(
        f"| {len(to_ready)} (all clean) | {statistics.median(to_ready):.2f} | {max(to_ready):.2f} "
        f"| {statistics.median(logged):.2f} | {max(logged):.2f} |"
    )


if __name__ == "__main__":
    main()
