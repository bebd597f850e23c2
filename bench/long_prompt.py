"""Inter-token latency of decoding streams while a prompt of the model's whole context prefills, against the same
streams alone: with the chunk sized automatically to ``--itl-target-ms``, and with fixed ``--prefill-chunk`` sizes,
in one run.

Run: .venv/bin/python bench/long_prompt.py [--targets 200 1000] [--chunks 64 256 1024] [--streams 3]
     [--model FOLDER] [--context N]

Each row is a fresh ``neuron serve`` (TP=1, the prefix cache off so the prompt is computed). An automatic row
serves ``--itl-target-ms T`` with ``--prefill-chunk`` at the whole context (the target alone sizes the chunks); a
fixed row serves ``--prefill-chunk C`` with ``--itl-target-ms 0``. ``--streams`` streams that generate past
end-of-sequence (testkit.streams) run first alone for a window of 60 tokens each, then while a prompt of
``context - 1`` tokens is sent, timed to its first token. The gaps between each stream's tokens that overlap those
windows give p50 and p99. The model is the embedded SmolLM2-135M unless ``--model`` names a folder; ``--context``
(default: the model's) is the server's ``--max-context``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit import Server  # noqa: E402
from testkit.streams import Window, measure  # noqa: E402


def run(model: Path, chunking: tuple[str, ...], context: int, streams: int) -> tuple[Window, Window]:
    log = Path(tempfile.gettempdir()) / f"neuron-bench-long-{os.getpid()}.log"
    server = Server("--model", str(model), "--max-context", str(context), *chunking, "--prefix-cache-bytes", "0",
                    log_path=log)  # fmt: skip
    name = model.name
    try:
        server.start()
        measure(server.url, name, streams=streams, window_tokens=10)  # warms the decode path
        alone = measure(server.url, name, streams=streams, window_tokens=60)
        prompt = [(7 * i) % 1000 + 100 for i in range(context - 1)]
        during = measure(server.url, name, streams=streams, long_prompt=prompt)
        return alone, during
    finally:
        server.stop()
        log.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", type=float, nargs="*", default=[200.0, 1000.0], help="--itl-target-ms rows")
    parser.add_argument("--chunks", type=int, nargs="*", default=[64, 256, 1024], help="fixed --prefill-chunk rows")
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--context", type=int)
    args = parser.parse_args()
    if args.model is None:
        from neuron.models.folder import resolve

        args.model = resolve(None)
    context = args.context or json.loads((args.model / "config.json").read_text())["max_position_embeddings"]
    print(f"{args.streams} decoding streams, a prompt of {context - 1} tokens, model {args.model.name}, one run\n")
    print(
        "| chunk | target ms | ITL p50 ms alone | ITL p99 ms alone | ITL p50 ms during | ITL p99 ms during "
        "| p99 during / alone | p99 during / target | tokens per stream during | long prompt's TTFT s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [(f"auto (cap {context})", t, ("--prefill-chunk", str(context), "--itl-target-ms", f"{t:g}"))
            for t in args.targets]  # fmt: skip
    rows += [(f"fixed {c}", 0.0, ("--prefill-chunk", str(c), "--itl-target-ms", "0")) for c in args.chunks]
    for label, target, chunking in rows:
        alone, during = run(args.model, chunking, context, args.streams)
        got = min(s.between(during.start, during.end) for s in during.streams)
        p99 = 1000 * during.percentile(99)
        print(
            f"| {label} | {f'{target:g}' if target else '-'} | {1000 * alone.percentile(50):.0f} "
            f"| {1000 * alone.percentile(99):.0f} | {1000 * during.percentile(50):.0f} | {p99:.0f} "
            f"| {during.percentile(99) / alone.percentile(99):.1f} | {f'{p99 / target:.1f}' if target else '-'} "
            f"| {got} | {during.end - during.start:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
