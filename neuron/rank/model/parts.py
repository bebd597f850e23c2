"""A loaded model's parts as mlx-lm builds them: its backbone (the layers and the final norm, no head), and whether
its head gathers the vocabulary's rows inside the model's own call. Read by the runner, the image encoder, the
rotary positions, LoRA and the drafters, none of which loads a model."""

from __future__ import annotations

import mlx.nn as nn


def backbone(model: nn.Module) -> nn.Module:
    """The model without its final projection to the vocabulary (the final norm included).

    Where the head is not split (``VocabSlice``), workers run only this: mlx-lm's
    ``shard()`` replicates the head, and skipping it spares workers the largest
    single matrix product of a decode step, whose result only rank 0 would use.
    """
    inner = getattr(model, "model", None)
    if inner is None and isinstance(language := getattr(model, "language_model", None), nn.Module):
        inner = getattr(language, "model", None)  # a vision-language model's (mistral3's) language model
    return inner if isinstance(inner, nn.Module) and hasattr(inner, "layers") else model


def head_gathers(model: nn.Module) -> bool:
    """Whether mlx-lm's ``shard()`` split the projection to the vocabulary, which then gathers its rows inside the
    model's own call (qwen3_5's, where the embedding is not tied)."""
    language = getattr(model, "language_model", model)
    return getattr(language, "sharding_group", None) is not None
