"""SmolLM2 widened so that two ranks split it, computing the same function: for the benchmarks that need a real
model's text (speculation's acceptance) at TP=2.

SmolLM2-135M has 9 query heads over 3 key/value heads, so only TP=1, 3 or 9 split it. Widened: every key/value
head is stored twice (6), and each group of three query heads gets a fourth whose query weights and output-projection
columns are zero (12). A zero query attends uniformly, and its zero columns drop what it read, so the widened model
computes what SmolLM2 computes (up to the order of float sums), and 12 and 6 heads split over 2 ranks. The price is
12% more weights per layer (q, k, v and o are wider; the MLP and the embeddings are unchanged).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

QUERIES_PER_KV = 3  # SmolLM2: 9 query heads, 3 key/value heads
COPIES_PER_KV = 2  # each key/value head stored twice, each copy serving two query heads


def widened_smollm2(source: Path, folder: Path) -> Path:
    """Write the widened copy of the SmolLM2 MLX folder ``source`` into ``folder`` (made once) and return it."""
    import mlx.core as mx

    if (folder / "config.json").is_file():
        return folder
    config = json.loads((source / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads != QUERIES_PER_KV * kv_heads:
        raise SystemExit(f"{source}: {heads} query heads over {kv_heads} key/value heads is not SmolLM2's shape")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    weights = mx.load(str(source / "model.safetensors"))
    for name in list(weights):
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            weights[name] = _widen(name, weights[name], kv_heads, head_dim)
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    width = QUERIES_PER_KV + 1
    config |= {"num_attention_heads": kv_heads * width, "num_key_value_heads": kv_heads * COPIES_PER_KV}
    config["head_dim"] = head_dim
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for extra in source.iterdir():
        if extra.name not in ("config.json", "model.safetensors", "source.json"):
            shutil.copy(extra, folder / extra.name)
    return folder


def _widen(name: str, weight: mx.array, kv_heads: int, head_dim: int) -> mx.array:
    import mlx.core as mx

    if name.endswith(("k_proj.weight", "v_proj.weight")):
        per_head = weight.reshape(kv_heads, 1, head_dim, -1)
        return mx.repeat(per_head, COPIES_PER_KV, axis=1).reshape(-1, weight.shape[-1])
    if name.endswith("q_proj.weight"):
        per_group = weight.reshape(kv_heads, QUERIES_PER_KV, head_dim, -1)
        zero = mx.zeros((kv_heads, 1, head_dim, per_group.shape[-1]), weight.dtype)
        return mx.concatenate([per_group, zero], axis=1).reshape(-1, weight.shape[-1])
    per_group = weight.reshape(weight.shape[0], kv_heads, QUERIES_PER_KV, head_dim)  # o_proj: heads are columns
    zero = mx.zeros((weight.shape[0], kv_heads, 1, head_dim), weight.dtype)
    return mx.concatenate([per_group, zero], axis=2).reshape(weight.shape[0], -1)
