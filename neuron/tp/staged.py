"""A pipeline stage's layers run by neuron, for a model whose own call cannot run a stage of them.

Most models' own call runs a stage as it runs the whole model, once the stage's
layer list and its kinds are sliced (``shard.load_stage``). gemma3's cannot: it
scales the hidden states it is given by the square root of their width (the
embedding's scale, which a later stage would apply a second time), and it picks
each layer's mask and cache kind by the layer's number in the list (every
``sliding_window_pattern``-th is global), which slicing renumbers. Its layers
know their own kind (``self_attn.is_sliding``, from their number in the whole
model), so a stage reads that instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

# A stage's layers over tokens (rank 0: embedded here) or the hidden states received from the stage before.
StageCall = Callable[[nn.Module, mx.array, Sequence[Any], mx.array | None], mx.array]


def _gemma3(inner: nn.Module, tokens: mx.array, cache: Sequence[Any], received: mx.array | None) -> mx.array:
    """``Gemma3Model.__call__`` for a stage: the embedding scaled on the first stage alone, each layer given the
    mask of its own kind, made from the stage's first cache of that kind."""
    if received is None:
        h = inner.embed_tokens(tokens)
        h *= mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
    else:
        h = received
    sliding = [layer.self_attn.is_sliding for layer in inner.layers]
    full_cache = next((c for c, s in zip(cache, sliding, strict=True) if not s), None)
    window_cache = next((c for c, s in zip(cache, sliding, strict=True) if s), None)
    full_mask = create_attention_mask(h, full_cache)
    window_mask = create_attention_mask(h, window_cache, window_size=inner.window_size)
    for layer, c, is_sliding in zip(inner.layers, cache, sliding, strict=True):
        h = layer(h, window_mask if is_sliding else full_mask, c)
    return inner.norm(h)


def _gemma3_caches(inner: nn.Module) -> Callable[[], list[Any]]:
    def make_cache() -> list[Any]:
        return [
            RotatingKVCache(max_size=inner.window_size) if layer.self_attn.is_sliding else KVCache()
            for layer in inner.layers
        ]

    return make_cache


_CALLS: dict[str, tuple[StageCall, Callable[[nn.Module], Callable[[], list[Any]]]]] = {
    "gemma3_text": (_gemma3, _gemma3_caches),
}


def own_call(model: nn.Module, inner: nn.Module) -> StageCall | None:
    """neuron's call for a stage of ``model`` (``inner``: its layers' owner, sliced to the stage), or None where
    the model's own call serves; a model that gets one also gets a ``make_cache`` for the stage's layers alone."""
    found = _CALLS.get(str(getattr(model, "model_type", "")))
    if found is None:
        return None
    call, caches = found
    model.make_cache = caches(inner)  # mlx-lm's make_prompt_cache asks the model for its caches
    return call
