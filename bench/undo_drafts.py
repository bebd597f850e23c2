"""What undoing rejected drafts would cost a model whose caches cannot be cut back (a sliding window, a
linear-attention state), against cutting them back where they can be.

Run: .venv/bin/python bench/undo_drafts.py [--hidden 576 --layers 30 --heads 9 --kv-heads 3 --rounds 15]

Where every cache is plain keys and values, a rejected draft's tokens are cut
off the cache (``rank/kv/rollback.py``), at next to no cost. A rotating window has
overwritten what it held, and a state has folded the tokens in, so the only
undo is to copy those layers before every verify step and, where a row
rejected part of its draft, put the copy back and feed again the tokens it
kept: a second forward. One row, greedy, on random weights of two shapes,
SmolLM2-135M's shape by default (its head and MLP, 49,152 tokens): mistral
with alternating sliding layers (a window of 128 after a 256-token prompt) and
qwen3_5 (gated delta net every layer but every fourth, heads as attention's). Medians of ``--rounds``,
in ms:

- ``step``: one token, the plain decode step;
- ``verify W``: the token and a draft of W - 1;
- ``copy``: the copy of the non-cuttable layers, evaluated;
- ``refeed k``: the copy put back and k tokens fed again.

And what follows: the tokens per ms of drafting W - 1 at acceptance p with the
undo (verify, copy, and a refeed of the kept tokens unless the whole draft was
kept), against a plain step's one token, and the break-even p.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import _get_classes

PROMPT = 256
WIDTH = 5  # a verify step: the token and a 4-token draft


def _config(arch: str, hidden: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    base = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 8 // 3,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    if arch == "windowed_mistral":
        kinds = ["sliding_attention", "full_attention"] * (layers // 2)
        return {**base, "model_type": "mistral", "sliding_window": 128, "layer_types": kinds}
    linear = {
        "linear_num_value_heads": heads,
        "linear_num_key_heads": kv_heads,
        "linear_key_head_dim": hidden // heads,
        "linear_value_head_dim": hidden // heads,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
    }
    return {"model_type": "qwen3_5", "text_config": {**base, **linear, "model_type": "qwen3_5_text"}}


def _median_ms(run: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(arch: str, args: argparse.Namespace) -> dict[str, float]:
    config = _config(arch, args.hidden, args.layers, args.heads, args.kv_heads)
    rounds = args.rounds
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(PROMPT)[None] % 1000, cache=cache))
    undoable = [layer for layer in cache if type(layer) is not KVCache]

    def forward(width: int) -> None:
        mx.eval(model(mx.ones((1, width), dtype=mx.int32), cache=cache))

    def snapshot() -> list[Any]:
        kept = [copy.deepcopy(layer) for layer in undoable]
        mx.eval([[a for a in vars(layer).values() if isinstance(a, mx.array)] for layer in kept])
        mx.eval([[a for a in getattr(layer, "cache", []) if a is not None] for layer in kept])
        return kept

    forward(1)  # warm up every kernel once
    out = {"step": _median_ms(lambda: forward(1), rounds)}
    out[f"verify {WIDTH}"] = _median_ms(lambda: forward(WIDTH), rounds)
    out["copy"] = _median_ms(snapshot, rounds)
    for k in range(1, WIDTH):
        out[f"refeed {k}"] = _median_ms(lambda k=k: (snapshot(), forward(k)), rounds) - out["copy"]
    return out


def rate_with_undo(figures: dict[str, float], p: float) -> float:
    """Tokens per ms drafting WIDTH - 1 at per-token acceptance p, with the copy and the refeed."""
    drafted = WIDTH - 1
    kept = [p**i * (1 - p) for i in range(drafted)] + [p**drafted]  # exactly i kept, i < drafted; all kept
    tokens = sum((i + 1) * chance for i, chance in enumerate(kept))
    refeed = sum(chance * figures[f"refeed {i + 1}"] for i, chance in enumerate(kept[:-1]))
    return tokens / (figures[f"verify {WIDTH}"] + figures["copy"] + refeed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    for arch in ("windowed_mistral", "qwen3_5"):
        figures = measure(arch, args)
        plain = 1 / figures["step"]
        even = next((p / 100 for p in range(101) if rate_with_undo(figures, p / 100) >= plain), None)
        print(arch, " ".join(f"{name} {ms:.1f}" for name, ms in figures.items()))
        for p in (0.3, 0.5, 0.7, 0.9):
            cut = sum(p**i for i in range(WIDTH)) / figures[f"verify {WIDTH}"]  # a plain cache's trim costs nothing
            print(f"  p={p}: with the undo {rate_with_undo(figures, p) / plain:.2f}x, cut back {cut / plain:.2f}x")
        print(f"  break-even p with the undo: {even}")


if __name__ == "__main__":
    main()
