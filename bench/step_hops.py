"""One steady decode step of the engine (no HTTP), cut at its thread hops, in microseconds: how long rank 0's thread
takes to wake for its job, the job itself, the event loop's wake-up once it ends, and the event loop's turn until
the next job is queued.

Run: .venv/bin/python bench/step_hops.py [--generate 256,4,4,512 | --model FOLDER] [--tokens 256] [--rounds 4]
         [--run-ahead off on]

The engine runs in this process, as ``bench/http_decode.py``'s engine path does, with the BLAS neuron preloads
(the script re-executes itself with it). Timestamps are taken where the job is queued, where rank 0's thread
starts it, where its step function returns and where the event loop learns of it; the medians over the steady
steps of each round (the first and last twenty steps left out) are printed, round by round, with mlx-lm's
own step in the same process for scale. With run-ahead on, rank 0 computes the next step after its reply
(``RunAhead.settle``): the wait for a job then holds that computation.
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPT = "Once upon a time, in a small village by the sea, there lived"
Stamps = list[tuple[str, float]]


def instrument(stamps: Stamps) -> None:
    """Stamp the hops: rank 0's job queue, its start, the step function's end, and the event loop's wake-up."""
    import neuron.pool.pool as pool
    import neuron.pool.rank0 as rank0

    class Stamped(queue.SimpleQueue):  # type: ignore[type-arg]
        def put(self, job: Callable[[], None] | None, block: bool = True, timeout: float | None = None) -> None:
            if job is None:
                return super().put(job)
            stamps.append(("queued", time.perf_counter()))

            def started() -> None:
                stamps.append(("started", time.perf_counter()))
                job()

            return super().put(started)

    rank0.queue.SimpleQueue = Stamped  # type: ignore[misc]
    wake, run = rank0._wake, pool.run

    def woken(future: object) -> None:
        stamps.append(("woken", time.perf_counter()))
        wake(future)  # type: ignore[arg-type]

    def stepped(*args: object, **kwargs: object) -> object:
        out = run(*args, **kwargs)  # type: ignore[arg-type]
        stamps.append(("ran", time.perf_counter()))
        return out

    rank0._wake = woken
    pool.run = stepped  # type: ignore[assignment]


HOPS = {
    ("queued", "started"): "rank 0's thread wakes for its job",
    ("started", "ran"): "rank 0's job (step, sampling, read)",
    ("ran", "woken"): "the event loop wakes to the reply",
    ("woken", "queued"): "the event loop's turn until the next job",
    ("queued", "queued"): "one step",
}


def hops(stamps: Stamps) -> dict[str, float]:
    gaps: dict[str, list[float]] = {name: [] for name in HOPS.values()}
    last: dict[str, float] = {}
    for kind, at in stamps[20:-20]:
        for (before, after), name in HOPS.items():
            if kind == after and before in last:
                gaps[name].append(at - last[before])
        last[kind] = at
    return {name: statistics.median(values) * 1e6 for name, values in gaps.items() if values}


def mlx_lm_step(model: str, tokens: int) -> float:
    """mlx-lm's own decode step here, in µs: the median gap between ``stream_generate``'s tokens."""
    from mlx_lm import load, stream_generate

    loaded, tokenizer = load(model)
    stamps = [time.perf_counter() for _ in stream_generate(loaded, tokenizer, PROMPT, max_tokens=tokens)]
    return statistics.median(b - a for a, b in itertools.pairwise(stamps)) * 1e6


async def engine_rounds(model: str, run_ahead: str, tokens: int, rounds: int) -> list[dict[str, float]]:
    from neuron.engine.engine import Engine
    from neuron.engine.scheduler import Scheduling
    from neuron.sampling_params import SamplingParams

    stamps: Stamps = []
    instrument(stamps)
    out = []
    limits = Scheduling(prefix_cache_bytes=0, run_ahead=run_ahead)
    async with Engine.open(Path(model), limits=limits) as engine:
        prompt = engine.text.encode(PROMPT)
        for i in range(rounds + 1):
            stamps.clear()
            seq = engine.submit(prompt, SamplingParams(max_tokens=tokens))
            async for _ in seq.events:
                pass
            if i:  # the first warms up
                out.append(hops(stamps))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="model folder (default: a generated qwen3 of --generate's shape)")
    parser.add_argument("--generate", default="256,4,4,512", metavar="HIDDEN,LAYERS,HEADS,INTERMEDIATE")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--run-ahead", nargs="+", default=["off", "on"], choices=["off", "on"])
    args = parser.parse_args()

    from http_decode import blas_env

    env = blas_env()
    if env.get("LD_PRELOAD") and os.environ.get("LD_PRELOAD") != env["LD_PRELOAD"]:
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)  # the BLAS neuron preloads
    from testkit import make_tiny_model

    model = args.model
    if model is None:
        hidden, layers, heads, intermediate = (int(x) for x in args.generate.split(","))
        model = str(
            make_tiny_model(Path(tempfile.mkdtemp()) / "qwen3", "qwen3", 0, hidden, layers, heads, intermediate)
        )
    results = {mode: anyio.run(engine_rounds, model, mode, args.tokens, args.rounds) for mode in args.run_ahead}
    baseline = mlx_lm_step(model, args.tokens)
    print(f"model {Path(model).name}, {args.tokens} tokens, load {os.getloadavg()[0]:.2f}; µs, median over the")
    print(f"steady steps of each round; mlx-lm's step in this process: {baseline:.0f} µs\n")
    columns = [(mode, i) for mode, rounds in results.items() for i in range(len(rounds))]
    print("| hop | " + " | ".join(f"run-ahead {mode}, round {i + 1}" for mode, i in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name in HOPS.values():
        cells = [results[mode][i].get(name) for mode, i in columns]
        print(f"| {name} | " + " | ".join("" if c is None else f"{c:.0f}" for c in cells) + " |")
    steps = [results[mode][i].get("one step") for mode, i in columns]
    print("| vs mlx-lm's step | " + " | ".join("" if s is None else f"{baseline / s:.2f}x" for s in steps) + " |")


if __name__ == "__main__":
    main()
