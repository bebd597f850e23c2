"""Every kind of cache mlx-lm builds for a model, handled alike: plain key/value caches, sliding windows
(``RotatingKVCache``), linear-attention state (``ArraysCache``) and lists of them (``CacheList``).

mlx-lm gives each kind its batched form and the operations batching needs
(``merge`` into a batch, ``extend`` it, ``filter`` rows out, ``extract`` one);
this module only picks them by kind, so the rest of ``tp`` never asks which
kind a layer holds. What differs is whether a cache can be cut back to an
earlier length: only plain key/value caches can (``neuron.models.architectures`` says
which models have only those), quantized (``--kv-bits``, ``rank.kv.quantized``)
or not.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList, KVCache, QuantizedKVCache, make_prompt_cache

from neuron.rank.kv import quantized
from neuron.rank.kv.quantized import BatchQuantizedKVCache
from neuron.rank.kv.states import Recording

Layer = Any  # one layer's cache: any of mlx-lm's kinds, alone or batched


def fresh(model: nn.Module) -> list[Layer]:
    """A new sequence's caches, one per layer that keeps one (a model may share a layer's cache with another)."""
    return make_prompt_cache(model)


def merge(caches: list[list[Layer]]) -> list[Layer]:
    """The batched caches of several sequences (each a list of per-layer caches), rows in the given order."""
    out = []
    for i, layer in enumerate(caches[0]):
        kind = BatchQuantizedKVCache if isinstance(layer, QuantizedKVCache) else layer
        if type(layer) is ArraysCache:  # a batch's linear-attention states drop a rejected draft (rank.states)
            kind = Recording
        out.append(kind.merge([cache[i] for cache in caches]))
    return out


def padded_batch(fresh_caches: list[Layer], padding: list[int]) -> list[BatchKVCache]:
    """Empty batched caches for new prompts left-padded by ``padding``, quantized where ``fresh_caches`` (a fresh
    sequence's) are; the model keeps plain key/value caches only."""
    return [
        BatchQuantizedKVCache(padding, layer.group_size, layer.bits)
        if isinstance(layer, QuantizedKVCache)
        else BatchKVCache(padding)
        for layer in fresh_caches
    ]


def cuttable(cache: list[Layer]) -> bool:
    """Whether every layer of a batch can be cut back to any earlier length: plain key/value layers, quantized or
    not."""
    return all(isinstance(layer, BatchKVCache) for layer in cache)


def droppable(cache: list[Layer]) -> bool:
    """Whether every layer of a batch can drop what its last step fed past what it kept: the layers that can be
    cut, and linear-attention states that kept each position's (``rank.kv.states``)."""
    return all(isinstance(layer, (BatchKVCache, Recording)) for layer in cache)


def empty_batch(model: nn.Module, rows: int) -> list[Layer]:
    """Batched caches of ``rows`` sequences that hold nothing yet (a shadow step's throwaway caches)."""
    return merge([fresh(model) for _ in range(rows)])


def copied(cache: list[Layer]) -> list[Layer]:
    """A copy of one sequence's caches with arrays of its own: the copy's writes must not reach the original."""
    out: list[Layer] = []
    for layer in cache:
        if type(layer) is KVCache:
            copied = KVCache()
            if layer.keys is not None:
                copied.keys, copied.values = mx.array(layer.keys), mx.array(layer.values)
            copied.offset = layer.offset
            out.append(copied)
        elif isinstance(layer, QuantizedKVCache):
            twin_layer = QuantizedKVCache(layer.group_size, layer.bits)
            if layer.keys is not None:
                twin_layer.keys, twin_layer.values = quantized.copied(layer.keys), quantized.copied(layer.values)
            twin_layer.offset = layer.offset
            out.append(twin_layer)
        else:
            out.append(copy.deepcopy(layer))  # what mlx-lm's BatchGenerator does to split a batch
    return out


def arrays(layer: Layer) -> list[mx.array]:
    """The arrays a layer's cache holds, for evaluating them with a forward pass."""
    if isinstance(layer, CacheList):
        return [a for inner in layer.caches for a in arrays(inner)]
    if isinstance(layer, ArraysCache):
        held: list[mx.array | None] = list(layer.cache)  # mlx-lm types the slots as None until filled
        return [a for a in held if a is not None]
    if isinstance(layer, (QuantizedKVCache, BatchQuantizedKVCache)):
        keys, values = layer.state[:2]  # each (packed, scales, biases), or None before the first write
        return [] if keys is None else [*keys, *values]
    return [a for a in (layer.keys, layer.values) if a is not None]


def nbytes(held: Any) -> int:
    """Bytes the caches in ``held`` take: a layer of any kind, a list of them, or a prefix entry's keys and values
    (tuples of arrays, quantized ones tuples of their own)."""
    if held is None:
        return 0
    if isinstance(held, mx.array):
        return int(held.nbytes)
    if isinstance(held, (list, tuple)):
        return sum(nbytes(part) for part in held)
    return sum(int(a.nbytes) for a in arrays(held))


def mark_single_row(cache: list[Layer], one_row: bool) -> None:
    """Mark a micro-batch's caches as holding one row with no left padding (``one_row``), or no longer.

    A batched cache masks every step for its rows' left padding; one row of one token with none needs no mask,
    as a plain cache has none, and building it and attending through it costs a tiny model's step a few percent
    (BENCHMARKS.md, issue 49). mlx-lm's merge of one cache and its filter down to one row both leave no padding,
    and dropping a draft's tail from one row trims without padding, so the mark holds until rows join.
    """
    for layer in cache:
        if type(layer) is not BatchKVCache:
            continue
        if one_row:
            # weak: a cycle would keep the cache alive until the collector ran
            layer.make_mask = functools.partial(_unpadded_mask, weakref.ref(layer))  # type: ignore[method-assign]
        else:
            layer.__dict__.pop("make_mask", None)


def _unpadded_mask(layer: weakref.ref[BatchKVCache], N: int, return_array: bool = False, **kwargs: Any) -> Any:
    if N == 1 and not return_array and kwargs.get("window_size") is None:
        return None
    cache = layer()
    assert cache is not None
    return BatchKVCache.make_mask(cache, N, return_array=return_array, **kwargs)
