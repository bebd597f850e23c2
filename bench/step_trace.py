"""Which of neuron's modules one steady decode step enters, on the leader (its event loop and rank 0's thread) and
on a worker: a call trace, not a sample.

Run: .venv/bin/python bench/step_trace.py [--turn 20 --tp 2]
A tiny generated llama served at ``--tp`` ranks through ``testkit.trace`` (a profile function on every thread of
every process, on for one whole turn of the engine's loop on the leader and for the handling of the same step on
each worker), one greedy stream decoding; prints each process's modules, in the order first entered, with the
times each was entered from another module (``testkit.stepwalk``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.stepwalk import LEADER, STREAMS, steady_step  # noqa: E402

WHO = {LEADER: "leader (the engine's loop and rank 0's thread)", STREAMS: "leader, its HTTP streams meanwhile"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turn", type=int, default=20)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        walks = steady_step(Path(tmp), args.tp, args.turn)
    for who, entered in walks.items():
        times = sum(n for _, n in entered)
        print(f"\n{WHO.get(who, 'a worker')}: {len(entered)} modules, entered {times} times\n")
        print(", ".join(f"{m.removeprefix('neuron.')} {n}" for m, n in entered))


if __name__ == "__main__":
    main()
