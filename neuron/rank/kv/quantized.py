"""The batched form of mlx-lm's quantized KV cache (``--kv-bits``), which mlx-lm does not have.

mlx-lm quantizes one sequence's cache (``QuantizedKVCache``: keys and values
each kept as mx.quantize's packed values, scales and biases) and its server
falls back to one request at a time when asked to (``kv_bits`` turns its
batching off). neuron batches every decode, so this is ``BatchKVCache``, the
left-padded batch neuron already uses, with each of keys and values held as
those three arrays: the mask, the padding and the trimming are ``BatchKVCache``'s
own; only what touches the arrays is here. Attention needs nothing of neuron:
mlx-lm's ``scaled_dot_product_attention`` takes the quantized path for any
cache that has ``bits`` (``mx.quantized_matmul`` on the packed keys and values).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll, make_prompt_cache

Quantized = tuple[mx.array, mx.array, mx.array]  # mx.quantize's packed values, scales and biases


def quantize_caches(model: nn.Module, group_size: int, bits: int) -> None:
    """Make every new cache of ``model`` (``caches.fresh``, mlx-lm's ``make_prompt_cache``) a quantized one; the
    model must keep plain key/value caches only (``architectures.check_kv_bits`` refused the others)."""
    layers = len(make_prompt_cache(model))
    assert all(type(c) is KVCache for c in make_prompt_cache(model))
    make: Callable[[], list[QuantizedKVCache]] = lambda: [QuantizedKVCache(group_size, bits) for _ in range(layers)]  # noqa: E731
    model.make_cache = make


def _each(change: Callable[[mx.array], mx.array], parts: Quantized) -> Quantized:
    """``change`` applied to the packed values, the scales and the biases alike."""
    a, b, c = (change(x) for x in parts)
    return a, b, c


def copied(parts: Quantized) -> Quantized:
    return _each(mx.array, parts)


def _sliced(parts: Quantized, rows: slice | mx.array, start: int = 0, end: int | None = None) -> Quantized:
    return _each(lambda x: x[rows, :, start:end], parts)


def _zeros(shape: tuple[int, int, int], dim: int, dtype: mx.Dtype, group_size: int, bits: int) -> Quantized:
    per_word = 32 // bits
    return (
        mx.zeros((*shape, dim // per_word), dtype=mx.uint32),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
    )


def _padded(parts: Quantized, left: int, right: int) -> Quantized:
    return _each(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), parts)


class BatchQuantizedKVCache(BatchKVCache):
    """``BatchKVCache`` whose keys and values are each (packed, scales, biases), quantized as they are written."""

    keys: Any  # each a ``Quantized`` once written to, None before (mlx-lm's attributes are untyped)
    values: Any
    _idx: int

    def __init__(self, left_padding: list[int], group_size: int, bits: int) -> None:
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits  # mlx-lm's attention takes its quantized path for a cache that has this

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        prev = self._idx
        batch, heads, steps, key_dim = keys.shape
        if self.keys is None or prev + steps > self.keys[0].shape[2]:
            grown = (batch, heads, (self.step + steps - 1) // self.step * self.step)
            new_keys = _zeros(grown, key_dim, keys.dtype, self.group_size, self.bits)
            new_values = _zeros(grown, values.shape[3], values.dtype, self.group_size, self.bits)
            if self.keys is None:
                self.keys, self.values = new_keys, new_values
            else:
                kept_keys, kept_values = (
                    _sliced(self.keys, slice(None), 0, prev),
                    _sliced(self.values, slice(None), 0, prev),
                )
                self.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(kept_keys, new_keys, strict=True))
                self.values = tuple(
                    mx.concatenate([a, b], axis=2) for a, b in zip(kept_values, new_values, strict=True)
                )
        self.offset = self.offset + steps
        self._idx += steps
        for held, fresh in ((self.keys, keys), (self.values, values)):
            for part, new in zip(held, mx.quantize(fresh, group_size=self.group_size, bits=self.bits), strict=True):
                part[..., prev : self._idx, :] = new
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Quantized, Quantized]:
        return _sliced(self.keys, slice(None), 0, self._idx), _sliced(self.values, slice(None), 0, self._idx)

    def finalize(self) -> None:
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys = _each(lambda x: dynamic_roll(x, padding[:, None], axis=2), self.keys)
            self.values = _each(lambda x: dynamic_roll(x, padding[:, None], axis=2), self.values)
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    def filter(self, batch_indices: list[int]) -> None:
        indices = mx.array(batch_indices)
        if self.keys is not None:
            self.keys, self.values = _sliced(self.keys, indices), _sliced(self.values, indices)
        self.offset = self.offset[indices]
        self.left_padding = self.left_padding[indices]
        shift = min(cast(list[int], self.left_padding.tolist()))  # padding every row has: dropped
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = (
                    _sliced(self.keys, slice(None), shift),
                    _sliced(self.values, slice(None), shift),
                )
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: BatchKVCache) -> None:
        """Append ``other``'s rows (a batch of this cache's kind), both right-aligned at the longer one's end."""
        assert isinstance(other, BatchQuantizedKVCache)
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        end = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        template = self if self.keys is not None else other

        def aligned(c: BatchQuantizedKVCache) -> tuple[Quantized, Quantized, mx.array]:
            left = end - c._idx
            if c.keys is None:
                rows = c.offset.shape[0]
                keys = _each(lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), dtype=x.dtype), template.keys)
                values = _each(lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), dtype=x.dtype), template.values)
            else:
                keys, values = c.keys, c.values
            right = size - keys[0].shape[2] - left
            if right < 0:
                keys, values = _sliced(keys, slice(None), 0, right), _sliced(values, slice(None), 0, right)
                right = 0
            if left or right:
                keys, values = _padded(keys, left, right), _padded(values, left, right)
            return keys, values, c.left_padding + left

        (mine_k, mine_v, mine_pad), (their_k, their_v, their_pad) = aligned(self), aligned(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(mine_k, their_k, strict=True))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(mine_v, their_v, strict=True))
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([mine_pad, their_pad])
        self._idx = end

    def extract(self, idx: int) -> QuantizedKVCache:
        cache = QuantizedKVCache(self.group_size, self.bits)
        padding = cast(list[int], self.left_padding.tolist())[idx]
        row = slice(idx, idx + 1)
        keys = _each(mx.contiguous, _sliced(self.keys, row, padding, self._idx))
        values = _each(mx.contiguous, _sliced(self.values, row, padding, self._idx))
        cache.state = (keys, values, self._idx - padding, self.group_size, self.bits)
        return cache

    @classmethod
    def merge(cls, caches: list[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """One batch of several sequences' quantized caches, left-padded to the longest."""
        group_size, bits = caches[0].group_size, caches[0].bits
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], group_size, bits)
        if longest == 0:
            return batch
        sample_keys, sample_values = next(c.state[:2] for c in caches if c.keys is not None)
        keys = [mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), dtype=x.dtype) for x in sample_keys]
        values = [mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), dtype=x.dtype) for x in sample_values]
        for i, (c, n) in enumerate(zip(caches, lengths, strict=True)):
            if c.keys is None:
                continue
            for held, own in ((keys, c.keys), (values, c.values)):
                for part, x in zip(held, own, strict=True):
                    part[i : i + 1, :, longest - n :] = x[..., :n, :]
        batch.keys, batch.values = tuple(keys), tuple(values)
        batch.offset += longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(x.nbytes for x in (*self.keys, *self.values))
