"""What embeddings cost and what they cost a running stream: one request of many short inputs fed together (left-
padded) and fed one by one, a long input against the same tokens as a prompt, and one greedy stream's time per
token alone and while a client embeds without pause.

Run: .venv/bin/python bench/embeddings.py [--model FOLDER] [--rounds 3] [--prefill-chunk 512]

neuron's engine at TP=1 in this process (as ``neuron generate`` runs it; OpenBLAS when the environment preloads
it, ``LD_PRELOAD``). Each round runs every case once, so that the machine's noise hits them alike; a figure is the
median over rounds. "short" is 32 inputs of about 10 tokens; "one by one" feeds each on its own, as for a model
whose caches cannot take left padding. The long input is about 1,300 tokens, fed in chunks; "as a prompt" is the
same tokens generating one token. The stream decodes 32 tokens after its first; "while embedding" a task submits
the short request again as soon as the last one is answered, for the stream's whole life. Prints a markdown
table; trust the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHORT = [f"Sentence number {i} says something short." for i in range(32)]
LONG = " ".join(f"word{j} of passage 1," for j in range(160))
STREAM_TOKENS = 33


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    args = parser.parse_args()

    import anyio

    sys.path.insert(0, str(ROOT))
    from neuron.engine.engine import Engine
    from neuron.engine.scheduler import Scheduling
    from neuron.engine.sequence import Chunk, Sequence
    from neuron.models.folder import resolve
    from neuron.sampling_params import SamplingParams

    async def drain(seqs: list[Sequence]) -> float:
        started = time.perf_counter()
        for seq in seqs:
            async for _ in seq.events:
                pass
        return time.perf_counter() - started

    async def stream(engine: Engine, prompt: list[int]) -> float:
        seq = engine.submit(prompt, SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True))
        stamps = [time.perf_counter() async for event in seq.events if isinstance(event, Chunk)]
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    async def beside(engine: Engine, inputs: list[list[int]], prompt: list[int]) -> tuple[float, list[float]]:
        """The stream's time per token while a client embeds ``inputs`` again and again; each request's time."""
        done, served = anyio.Event(), []

        async def embedding() -> None:
            while not done.is_set():
                served.append(await drain(engine.embed(inputs, "bench")))

        async with anyio.create_task_group() as tg:
            tg.start_soon(embedding)
            during = await stream(engine, prompt)
            done.set()
        return during, served

    async def run() -> tuple[dict[str, list[float]], int, int]:
        figures: dict[str, list[float]] = {}
        limits = Scheduling(prefix_cache_bytes=0, prefill_chunk=args.prefill_chunk)
        async with Engine.open(resolve(args.model), limits=limits) as engine:
            rank = engine.pool._ranks.rank0.rank  # read by its own thread between steps: a flag for the one-by-one case
            assert rank is not None
            short = [engine.text.encode(text) for text in SHORT]
            long = engine.text.encode(LONG)
            prompt = engine.text.encode("Once upon a time")
            await drain(engine.embed(short, "bench"))  # warm
            for _ in range(args.rounds):
                figures.setdefault("short", []).append(await drain(engine.embed(short, "bench")))
                rank.prompts_together = False
                figures.setdefault("short one by one", []).append(await drain(engine.embed(short, "bench")))
                rank.prompts_together = True
                figures.setdefault("long", []).append(await drain(engine.embed([long], "bench")))
                prompted = [engine.submit(long, SamplingParams(max_tokens=1))]
                figures.setdefault("long as a prompt", []).append(await drain(prompted))
                figures.setdefault("stream", []).append(await stream(engine, prompt))
                during, served = await beside(engine, short, prompt)
                figures.setdefault("stream while embedding", []).append(during)
                figures.setdefault("short while streaming", []).append(statistics.median(served))
        return figures, sum(map(len, short)), len(long)

    figures, short_tokens, long_tokens = anyio.run(run)
    ms = {name: statistics.median(values) * 1000 for name, values in figures.items()}
    rows = [
        (f"32 short inputs ({short_tokens} tokens), fed together", f"{ms['short']:.0f} ms"),
        ("the same, fed one by one", f"{ms['short one by one']:.0f} ms"),
        (f"one long input ({long_tokens} tokens)", f"{ms['long']:.0f} ms"),
        ("the same tokens as a prompt, one token generated", f"{ms['long as a prompt']:.0f} ms"),
        ("one stream, alone", f"{ms['stream']:.1f} ms/token"),
        (
            "one stream, while a client embeds the 32 short inputs again and again",
            f"{ms['stream while embedding']:.1f} ms/token",
        ),
        ("the 32 short inputs, while the stream decodes", f"{ms['short while streaming']:.0f} ms"),
    ]
    print(f"| case | median of {args.rounds} |\n|---|---|")
    for case, figure in rows:
        print(f"| {case} | {figure} |")


if __name__ == "__main__":
    main()
