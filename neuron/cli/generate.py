"""``neuron generate``: one prompt through the engine, shown as ``mlx_lm.generate`` and ``ollama run`` show it.

The answer alone goes to stdout, as it is generated, so ``neuron generate ... >
out.txt`` holds just the text. stderr gets the rest: on a terminal, a progress
bar while the model loads (log.progress, gone once loaded); after the answer, one
summary line (tokens, tokens per second after the first, time to the first
token). Log lines are warnings and errors only unless ``--log-level`` asks for
more (settings.Logging), so nothing interleaves with the answer.
"""

from __future__ import annotations

import argparse
import sys
import time

from neuron.config.settings import Scheduling
from neuron.engine.engine import Engine
from neuron.engine.sequence import Failure, Finish
from neuron.models.folder import resolve
from neuron.pool import Deadlines, Layout


def summary(tokens: int, started: float, first: float | None, ended: float) -> str:
    """The line after the answer: tokens, tokens per second after the first token, time to the first token."""
    if first is None:
        return f"{tokens} tokens in {ended - started:.2f} s"
    rate = (tokens - 1) / (ended - first) if tokens > 1 and ended > first else tokens / max(ended - started, 1e-9)
    return f"{tokens} tokens, {rate:.1f} tokens/s, time to first token {first - started:.2f} s"


async def generate(args: argparse.Namespace, layout: Layout) -> None:
    path = resolve(args.model)
    deadlines = Deadlines(step=args.step_timeout)
    # One prompt per process: nothing to share in a prefix cache; the other scheduling settings are serve's.
    limits = Scheduling(prefix_cache_bytes=0, kv_bits=args.kv_bits)
    # On a terminal the engine's load shows a progress bar (log.progress) until it is done.
    async with Engine.open(path, layout, deadlines, limits, model=args.model) as engine:
        if args.chat:
            prompt = engine.text.encode_chat([{"role": "user", "content": args.prompt}])
        else:
            prompt = engine.text.encode(args.prompt)
        started, first = time.perf_counter(), None
        seq = engine.submit(prompt, args.sampling)
        try:
            async for event in seq.events:
                if isinstance(event, Failure):
                    raise RuntimeError(event.message)
                if first is None:
                    first = time.perf_counter()
                sys.stdout.write(event.text)
                sys.stdout.flush()
                if isinstance(event, Finish):
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                    print(summary(event.completion_tokens, started, first, time.perf_counter()), file=sys.stderr)
        finally:
            engine.cancel(seq)
