"""What a quantized KV cache (``--kv-bits``) saves and what it costs, against the unquantized cache, in one run.

Run: .venv/bin/python bench/kv_bits.py [--model FOLDER] [--tokens 1024] [--decode 128]

- Memory: the model loaded in this process as one rank loads it (``neuron.rank.model.load``), once per cache form
  (unquantized, 8 bits, 4 bits) and per activation dtype (as saved, and a copy of it whose floating-point
  weights are saved as bfloat16, so that its activations and cache are), a prompt of
  ``--tokens`` random tokens fed into a fresh cache. Bytes per token are the cache's arrays (allocated in steps
  of 256 tokens: ``--tokens`` a multiple of 256 leaves no slack) and the growth of ``mx.get_active_memory``
  across the feed (the cache, and whatever the forward leaves allocated), each over ``--tokens``; beside them
  the leader's estimate (``models.cache_bytes``) that sizes the prefix cache.
- Quality: three servers, one after the other (unquantized, ``--kv-bits 8``, ``--kv-bits 4``): the share of the
  unquantized model's greedy answer tokens that each quantized one also ranks first, teacher-forced
  (``testkit.agreement``), over its questions; and free-running, the share of each quantized server's own greedy
  answer before it first differs from the unquantized one's.
- Speed: each server's decode rate for one greedy stream of ``--decode`` tokens, against the unquantized one's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neuron.models.folder import resolve  # noqa: E402
from testkit import agreement  # noqa: E402
from testkit.server import Server  # noqa: E402

FORMS = (None, 8, 4)


def bfloat16_copy(model: Path, folder: Path) -> Path:
    """A copy of ``model`` whose floating-point weights are bfloat16 (quantized weights' scales too)."""
    import shutil

    import mlx.core as mx

    for path in model.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
            continue
        weights = mx.load(str(path))
        cast = {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
        mx.save_safetensors(str(folder / path.name), cast)
    return folder


def memory(models: list[Path], tokens: int) -> list[tuple[str, str, int, int, int]]:
    """(dtype, form, cache bytes per token, active-memory growth per token, the leader's estimate per token)."""
    import mlx.core as mx

    from neuron.models.folder import cache_bytes
    from neuron.rank.kv import caches
    from neuron.rank.model.load import load

    rows = []
    prompt = mx.random.randint(0, 1000, (1, tokens))
    for model in models:
        for bits in FORMS:
            share = load(str(model), [], 0, 1, None, bits)
            cache = caches.fresh(share.model)
            mx.synchronize()
            before = mx.get_active_memory()
            share.runner.feed(prompt, cache)
            mx.synchronize()
            grown = mx.get_active_memory() - before
            held = sum(a.nbytes for layer in cache for a in caches.arrays(layer))
            dtype = str(caches.arrays(cache[0])[-1].dtype).removeprefix("mlx.core.")
            estimate = cache_bytes(model, [], 1, bits)[0]
            rows.append((dtype, f"{bits} bits" if bits else "unquantized", held // tokens, grown // tokens, estimate))
            print(f"  measured {rows[-1]}", file=sys.stderr, flush=True)
            del share, cache
            mx.clear_cache()
            mx.synchronize()
    return rows


def decode_rate(server: Server, tokens: int) -> float:
    model = httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    started = time.perf_counter()
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600).json()
    return reply["usage"]["completion_tokens"] / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt tokens for the memory figures")
    parser.add_argument("--decode", type=int, default=128, help="tokens of the decode-rate stream")
    args = parser.parse_args()
    model = args.model or resolve(None)

    print(f"model {model.name}, {args.tokens} tokens")
    print("| activations | KV cache | bytes/token (cache) | bytes/token (active memory) | leader's estimate "
          "| vs unquantized |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        rows = memory([model, bfloat16_copy(model, Path(folder))], args.tokens)
    for dtype, form, held, grown, estimate in rows:
        base = next(r[2] for r in rows if r[0] == dtype and r[1] == "unquantized")
        print(f"| {dtype} | {form} | {held} | {grown} | {estimate} | {held / base:.3f} |")

    served: dict[int | None, tuple[float, float, float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        reference = Server("--model", str(model), log_path=Path(folder) / "reference.log").start()
        try:
            every = agreement.histories(reference, agreement.QUESTIONS)
            served[None] = (1.0, 1.0, decode_rate(reference, args.decode))
            for bits in FORMS[1:]:
                flags = ("--model", str(model), "--kv-bits", str(bits))
                other = Server(*flags, log_path=Path(folder) / f"{bits}.log").start()
                try:
                    forced = agreement.agreement(reference, other, every)
                    free = agreement.free_running(other, agreement.QUESTIONS, every)
                    served[bits] = (forced, free, decode_rate(other, args.decode))
                finally:
                    other.stop()
        finally:
            reference.stop()
    print()
    print(f"| KV cache | greedy agreement, teacher-forced ({len(agreement.QUESTIONS)} answers x {agreement.TOKENS} "
          "tokens) | free-running, share before the first difference | decode tokens/s | vs unquantized |")  # fmt: skip
    print("|---|---|---|---|---|")
    for bits, (forced, free, speed) in served.items():
        form = f"{bits} bits" if bits else "unquantized"
        print(f"| {form} | {forced:.3f} | {free:.3f} | {speed:.1f} | {speed / served[None][2]:.2f} |")


if __name__ == "__main__":
    main()
