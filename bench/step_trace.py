"""Which of neuron's modules one steady decode step enters, on the leader (its event loop and rank 0's thread) and
on a worker: a call trace, not a sample.

Run: .venv/bin/python bench/step_trace.py [--turn 20 --tp 2]
A tiny generated llama served at ``--tp`` ranks through ``testkit.trace`` (a profile function on every thread of
every process, on for one whole turn of the engine's loop on the leader and for the handling of the same step on
each worker), one greedy stream decoding; prints each process's modules, in the order first entered, with the
times each was entered from another module.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.models import make_tiny_model  # noqa: E402
from testkit.server import Server  # noqa: E402
from testkit.trace import OUT_ENV, TURN_ENV  # noqa: E402

WHO = {"": "leader (the engine's loop and rank 0's thread)", ".streams": "leader, its HTTP streams meanwhile"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turn", type=int, default=20)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", "llama")
        out = Path(tmp) / "trace"
        env = {TURN_ENV: str(args.turn), OUT_ENV: str(out)}
        server = Server("--model", str(model), "--tp", str(args.tp), log_path=Path(tmp) / "serve.log",
                        module="testkit.trace", env=env)  # fmt: skip
        try:
            server.start()
            body = {"model": model.name, "prompt": "hello", "max_tokens": 3 * args.turn, "temperature": 0.0}
            reply = httpx.post(f"{server.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=300)
            assert reply.status_code == 200, reply.text
            leader = server.process.pid
        finally:
            server.stop()
        for path in sorted(Path(tmp).glob("trace.*")):
            entered = [line.split() for line in path.read_text().splitlines()]
            who = WHO.get(path.name.removeprefix(f"trace.{leader}"), "a worker")
            times = sum(int(n) for _, n in entered)
            print(f"\n{who}: {len(entered)} modules, entered {times} times\n")
            print(", ".join(f"{m.removeprefix('neuron.')} {n}" for m, n in entered))


if __name__ == "__main__":
    main()
