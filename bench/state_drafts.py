"""What keeping a linear-attention layer's state per position costs a verify step (``rank/kv/states.py``), and what
taking a row's back costs, against the same forward without them.

Run: .venv/bin/python bench/state_drafts.py [--hidden 1024 --layers 8 --heads 16 --rows 1 4 --widths 1 5 9]

A generated Qwen3-Next (bench/draft.py's shape: three gated delta layers in four, MoE), fp32, random weights, a
64-token prompt per row, in one process. For each batch size and width W (the token and a draft of W - 1), medians
of ``--rounds`` in ms, rounds alternating so that a slow spell lands on both:

- ``plain``: the batched forward as mlx-lm computes it (its ``ArraysCache``, nothing kept);
- ``kept``: the same forward with every gated delta layer keeping each position's state and convolution input
  (``Recording`` armed);
- ``take back``: each row taking back the state of a different kept position (``drop_tail``), evaluated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.utils import _get_classes

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main() -> None:
    from draft import _next_fields

    from neuron.rank.kv import caches, states
    from neuron.rank.kv.rollback import drop_tail

    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 5, 9])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    config = {
        "model_type": "qwen3_next",
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "intermediate_size": args.intermediate,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads // 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "vocab_size": 259,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        **_next_fields(args),
    }
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p * 4.0 if p.ndim >= 2 else p, model.parameters()))
    mx.eval(model.parameters())
    states.hook(model)
    print("| rows | width | plain | kept | kept / plain | take back |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        own = [caches.fresh(model) for _ in range(rows)]
        for cache in own:
            model(mx.random.randint(0, 259, (1, 64)), cache=cache)
            mx.eval([caches.arrays(layer) for layer in cache])
        for width in args.widths:
            tokens = mx.random.randint(0, 259, (rows, width))
            times: dict[str, list[float]] = {"plain": [], "kept": [], "back": []}
            for _ in range(args.rounds):
                for kind in ("plain", "kept"):
                    batch = caches.merge([caches.copied(cache) for cache in own])
                    if kind == "plain":  # mlx-lm's own kind, which the hooks leave alone
                        batch = [_plain(layer) for layer in batch]
                    mx.eval([caches.arrays(layer) for layer in batch])
                    started = time.perf_counter()
                    states.record_each_position(batch, kind == "kept")
                    logits = model(tokens, cache=batch)
                    states.stop_recording(batch)
                    mx.eval(logits, [caches.arrays(layer) for layer in batch])
                    times[kind].append((time.perf_counter() - started) * 1000)
                if width > 1:
                    started = time.perf_counter()
                    drop_tail(batch, [i % width for i in range(rows)])
                    mx.eval([caches.arrays(layer) for layer in batch])
                    times["back"].append((time.perf_counter() - started) * 1000)
            plain, kept = statistics.median(times["plain"]), statistics.median(times["kept"])
            back = f"{statistics.median(times['back']):.2f}" if times["back"] else "-"
            print(f"| {rows} | {width} | {plain:.1f} | {kept:.1f} | {kept / plain:.2f} | {back} |")
            sys.stdout.flush()


def _plain(layer: object) -> object:
    from mlx_lm.models.cache import ArraysCache

    from neuron.rank.kv.states import Recording

    if not isinstance(layer, Recording):
        return layer
    plain = ArraysCache(len(layer.cache))
    plain.cache = list(layer.cache)
    return plain


if __name__ == "__main__":
    main()
