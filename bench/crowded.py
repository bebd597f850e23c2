"""Ranks on one host's cores: the embedded SmolLM2's decode at one rank, in two pipeline stages, and over three
tensor-parallel ranks, each a fresh ``neuron generate``, round by round.

Run: .venv/bin/python bench/crowded.py [--rounds 3] [--tokens 64]

On a two-core machine the three ranks share the cores (the leader warns, ``ranks outnumber cores``): every
collective waits on a rank that is not running, while the waiting rank sleeps in the kernel
(``neuron/system/sockets.py``). The ratio column is each split's speed over one rank's, medians of the same run; the
CPU column is the seconds of CPU the run's processes spent, leader and workers together.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPLITS = {"--tp 1": ["--tp", "1"], "--pp 2": ["--pp", "2"], "--tp 3": ["--tp", "3"]}
QUESTION = "Tell me a long story about the sea."


def run(split: list[str], tokens: int) -> tuple[float, float]:
    """One ``neuron generate``: its tokens a second, and the CPU seconds its processes spent."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, "-m", "neuron", "generate", "--chat", *split, "--max-tokens", str(tokens),
         "--temperature", "0", QUESTION],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"([\d.]+) tokens/s", done.stderr)
    assert found, done.stderr[-2000:]
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return float(found.group(1)), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in SPLITS}
    for _ in range(args.rounds):
        for name, split in SPLITS.items():
            results[name].append(run(split, args.tokens))
    one = statistics.median(speed for speed, _ in results["--tp 1"])
    print(f"\n{args.rounds} rounds, {args.tokens} tokens, {len(os.sched_getaffinity(0))} cores\n")
    print("| split | tok/s | ÷ one rank | CPU s a run |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        speed = statistics.median(s for s, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"| {name} | {speed:.1f} | {speed / one:.2f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
