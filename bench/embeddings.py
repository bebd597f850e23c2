"""What embeddings cost and what they cost a running stream: one embedding request of many short inputs and one of
a few long ones, alone; then one greedy stream's time per token alone and while a client embeds without pause.

Run: .venv/bin/python bench/embeddings.py [--model FOLDER] [--rounds 3] [--prefill-chunk 512] [--one-by-one]

neuron's engine at TP=1 in this process (as ``neuron generate`` runs it; OpenBLAS when the environment preloads
it). Each figure is the median over rounds. "short" is 32 inputs of about 12 tokens, "long" 4 of about 480; a
request's time runs from its submission to its last vector. The stream decodes 32 tokens after its first; "while
embedding" a task submits the short request again as soon as the last one is answered, for the stream's whole life.
``--one-by-one`` feeds every input on its own, as for a model whose caches cannot take left padding (the figure
to compare the batched forward of whole inputs with).
Prints a markdown table; trust the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHORT = [f"Sentence number {i} says something short." for i in range(32)]
LONG = [" ".join(f"word{j} of passage {i}," for j in range(160)) for i in range(4)]
STREAM_TOKENS = 33


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--one-by-one", action="store_true")
    args = parser.parse_args()

    import anyio

    sys.path.insert(0, str(ROOT))
    from neuron.engine.engine import Engine
    from neuron.engine.scheduler import Scheduling
    from neuron.engine.sequence import Chunk, Sequence
    from neuron.models import resolve
    from neuron.sampling_params import SamplingParams

    async def vectors(seqs: list[Sequence]) -> None:
        for seq in seqs:
            async for _ in seq.events:
                pass

    async def embed(engine: Engine, prompts: list[list[int]]) -> float:
        started = time.perf_counter()
        await vectors(engine.embed(prompts, "bench"))
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
                served.append(await embed(engine, inputs))

        async with anyio.create_task_group() as tg:
            tg.start_soon(embedding)
            during = await stream(engine, prompt)
            done.set()
        return during, served

    async def run() -> dict[str, list[float]]:
        figures: dict[str, list[float]] = {}
        limits = Scheduling(prefix_cache_bytes=0, prefill_chunk=args.prefill_chunk)
        async with Engine.open(resolve(args.model), limits=limits) as engine:
            if args.one_by_one:
                engine.pool._rank0.rank.prompts_together = False  # type: ignore[union-attr]  # read by its thread
            short = [engine.text.encode(text) for text in SHORT]
            long = [engine.text.encode(text) for text in LONG]
            prompt = engine.text.encode("Once upon a time")
            figures["tokens"] = [sum(map(len, short)), sum(map(len, long))]
            await embed(engine, short)  # warm
            for _ in range(args.rounds):
                figures.setdefault("short", []).append(await embed(engine, short))
                figures.setdefault("long", []).append(await embed(engine, long))
                figures.setdefault("stream", []).append(await stream(engine, prompt))
                during, served = await beside(engine, short, prompt)
                figures.setdefault("stream while embedding", []).append(during)
                figures.setdefault("short while streaming", []).append(statistics.median(served))
        return figures

    figures = anyio.run(run)
    short_tokens, long_tokens = figures.pop("tokens")
    median = {name: statistics.median(values) for name, values in figures.items()}
    print(f"| case | figure (median of {args.rounds}) |\n|---|---|")
    print(
        f"| 32 short inputs ({short_tokens} tokens), alone | {median['short'] * 1000:.0f} ms: "
        f"{32 / median['short']:.0f} inputs/s, {short_tokens / median['short']:.0f} tokens/s |"
    )
    print(
        f"| 4 long inputs ({long_tokens} tokens), alone | {median['long'] * 1000:.0f} ms: "
        f"{long_tokens / median['long']:.0f} tokens/s |"
    )
    print(f"| one stream, alone | {median['stream'] * 1000:.1f} ms/token |")
    print(
        f"| one stream, while a client embeds the 32 short inputs again and again | "
        f"{median['stream while embedding'] * 1000:.1f} ms/token |"
    )
    print(f"| the 32 short inputs, while the stream decodes | {median['short while streaming'] * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
