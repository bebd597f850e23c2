"""Random LoRA adapters for a tiny model, in mlx-lm's format (as ``mlx_lm.lora`` saves one) or PEFT's, and the
reference they are checked against: mlx-lm's own generation with the adapter loaded (``load(adapter_path=...)``)."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_KEYS = ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")


def make_adapter(
    model_path: Path,
    folder: Path,
    seed: int,
    rank: int = 4,
    scale: float = 2.0,
    layers: int = 3,
    keys: tuple[str, ...] = DEFAULT_KEYS,
    peft: bool = False,
) -> Path:
    """A LoRA adapter of ``model_path``'s last ``layers`` layers with random A and B (B nonzero, so that it changes
    the output), written as mlx-lm writes one, or as PEFT does (the same matrices, so the same output)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(model_path)
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}
    linear_to_lora_layers(model, layers, params)
    mx.random.seed(seed)
    trainable: list[tuple[str, mx.array]] = tree_flatten(model.trainable_parameters())  # type: ignore[assignment]
    weights = {name: mx.random.normal(w.shape) * (0.05 if name.endswith("lora_a") else 0.5) for name, w in trainable}
    folder.mkdir(parents=True)
    if not peft:
        mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
        config = {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": params}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        return folder
    renamed = {}
    for name, w in weights.items():
        stem, leaf = name.rsplit(".", 1)
        renamed[f"base_model.model.{stem}.lora_{leaf[-1].upper()}.weight"] = w.T
    mx.save_safetensors(str(folder / "adapter_model.safetensors"), renamed)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": scale * rank,
        "target_modules": sorted({k.rsplit(".", 1)[-1] for k in keys}),
        "base_model_name_or_path": str(model_path),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def reference(model_path: Path, adapter: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy tokens for ``prompt`` with ``adapter`` loaded (an mlx-lm format folder), or without."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model = load(str(model_path), adapter_path=str(adapter) if adapter else None)[0]
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        out.append(int(token))
    return out
