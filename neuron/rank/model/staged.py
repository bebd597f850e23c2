"""A pipeline stage's layers run by neuron, for a model whose own call cannot run a stage of them.

Most models' own call runs a stage as it runs the whole model, once the stage's
layer list and its kinds are sliced (``share.load_stage``). gemma3's cannot: it
scales the hidden states it is given by the square root of their width (the
embedding's scale, which a later stage would apply a second time), and it picks
each layer's mask and cache kind by the layer's number in the list (every
``sliding_window_pattern``-th is global), which slicing renumbers. Its layers
know their own kind (``self_attn.is_sliding``, from their number in the whole
model), so a stage reads that instead.

gemma4's cannot either: it too scales the embedding, and each of its layers
takes an input of its own computed from the tokens (a per-layer embedding
table and a projection of the scaled embedding, the model's alone), and its
last layers keep no keys and values but read those of the last earlier layer
of their kind. A stage computes its layers' inputs itself from the tokens,
every stage gets (it holds the embedding and its own columns of the
per-layer tables, ``slice_per_layer_inputs``), and the leader keeps each
reading layer in its source's stage (``launch.stages.keep_together``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

# A stage's layers over tokens (rank 0: embedded here, or given their input embeddings, where images replace
# some) or the hidden states received from the stage before.
StageCall = Callable[..., mx.array]
Held = mx.array | None
Caches = Sequence[Any]


def _gemma3(inner: nn.Module, tokens: mx.array, cache: Caches, received: Held, embeddings: Held = None) -> mx.array:
    """``Gemma3Model.__call__`` for a stage: the embedding (or the given input embeddings, as the model's own call
    takes them) scaled on the first stage alone, each layer given the mask of its own kind, made from the stage's
    first cache of that kind."""
    if received is None:
        h = inner.embed_tokens(tokens) if embeddings is None else embeddings
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


def _gemma4(inner: nn.Module, tokens: mx.array, cache: Caches, received: Held, embeddings: Held = None) -> mx.array:
    """``Gemma4TextModel.__call__`` for a stage: the embedding (or the given input embeddings, where images
    replace some: every stage gets them, ``rank.model.vision``) scaled, the per-layer inputs of the stage's layers
    computed from it and the tokens here, and each layer without keys and values of its own given those of the
    stage's last earlier layer of its kind (the leader kept that layer in this stage)."""
    layers = inner.layers
    width = inner.hidden_size_per_layer_input
    if embeddings is None and (received is None or width):
        embeddings = inner.embed_tokens(tokens)
    embedded = embeddings * inner.embed_scale if embeddings is not None else None
    h = received if received is not None else embedded
    per_layer: list[mx.array | None] = [None] * len(layers)
    if width:
        shape = (len(layers), width)
        own = mx.unflatten(inner.embed_tokens_per_layer(tokens) * inner.embed_tokens_per_layer_scale, -1, shape)
        projected = inner.per_layer_model_projection(embedded) * inner.per_layer_projection_scale
        projected = inner.per_layer_projection_norm(mx.unflatten(projected, -1, shape))
        inputs = (projected + own) * inner.per_layer_input_scale
        per_layer = [inputs[:, :, i, :] for i in range(len(layers))]
    cache = [*cache, *[None] * (len(layers) - len(cache))]  # the reading layers keep no cache
    masks = inner._make_masks(h, cache)  # from each kind's first layer here, which keeps its own (a reader follows)
    held: list[tuple[Any, Any]] = [(None, None)] * len(layers)
    wired = zip(layers, cache, masks, _kv_sources(layers), per_layer, strict=True)
    for i, (layer, c, mask, source, extra) in enumerate(wired):
        keys_values, offset = held[source]
        h, keys_values, offset = layer(h, mask, c, per_layer_input=extra, shared_kv=keys_values, offset=offset)
        held[i] = (keys_values, offset)
    return inner.norm(h)


def _kv_sources(layers: Sequence[nn.Module]) -> list[int]:
    """Whose keys and values each of a stage's layers uses: its own, or (a layer keeping none) the stage's last
    earlier layer of its kind that keeps them, as ``Gemma4TextModel.previous_kvs`` pairs them in the whole model."""
    sources, last_of_kind = [], {}
    for i, layer in enumerate(layers):
        if layer.self_attn.has_kv:
            last_of_kind[layer.layer_type] = i
            sources.append(i)
        elif layer.layer_type in last_of_kind:
            sources.append(last_of_kind[layer.layer_type])
        else:
            raise ValueError(
                f"layer {layer.layer_idx} reads an earlier layer's keys and values, and that layer is in another "
                "pipeline stage; split with --pp-layers so that one stage holds both"
            )
    return sources


def _gemma4_caches(inner: nn.Module) -> Callable[[], list[Any]]:
    _kv_sources(inner.layers)  # at load: a stage lacking a reading layer's source cannot run a step

    def make_cache() -> list[Any]:
        return [
            RotatingKVCache(max_size=inner.window_size, keep=0) if layer.self_attn.is_sliding else KVCache()
            for layer in inner.layers
            if layer.self_attn.has_kv
        ]

    return make_cache


def slice_per_layer_inputs(inner: nn.Module, first: int, end: int) -> bool:
    """Keep only layers ``[first, end)``'s share of a gemma4 model's per-layer input tables (its embedding's
    columns, its projection's rows: each layer's block of ``hidden_size_per_layer_input``, whole quantization
    groups); whether the model has them, so that every stage keeps the embedding they are computed from."""
    width = getattr(inner, "hidden_size_per_layer_input", 0)
    if not width:
        return False
    for module, axis in ((inner.embed_tokens_per_layer, -1), (inner.per_layer_model_projection, 0)):
        for name, array in module.parameters().items():  # weight, and a quantized table's scales and biases
            if isinstance(array, mx.array) and array.ndim == 2:
                block = array.shape[axis] // inner.config.num_hidden_layers
                kept = slice(first * block, end * block)
                module[name] = array[:, kept] if axis == -1 else array[kept]
    return True


def _gemma3_caches(inner: nn.Module) -> Callable[[], list[Any]]:
    def make_cache() -> list[Any]:
        return [
            RotatingKVCache(max_size=inner.window_size) if layer.self_attn.is_sliding else KVCache()
            for layer in inner.layers
        ]

    return make_cache


_CALLS: dict[str, tuple[StageCall, Callable[[nn.Module], Callable[[], list[Any]]]]] = {
    "gemma3_text": (_gemma3, _gemma3_caches),
    "gemma3": (_gemma3, _gemma3_caches),  # the vision-language model: its language model's stage
    "gemma4_text": (_gemma4, _gemma4_caches),
    "gemma4": (_gemma4, _gemma4_caches),
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
