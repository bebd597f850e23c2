"""Speculative decoding on the ranks: dropping from a row's KV cache what it was fed but did not keep.

Each decode row is fed ``[token] + draft`` (padded to its micro-batch's width)
in one batched forward; rank 0 keeps the run its sampler agrees with
(``sampler.Run``), and the next plan tells every rank how many tokens of
the row to drop from its cache (``Decode.drop``).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from neuron.rank.kv import caches
from neuron.rank.kv.states import Recording


def drop_tail(cache: list[BatchKVCache], drops: list[int]) -> None:
    """Drop ``drops[i]`` tokens from the end of row i in every layer: the rows drop different amounts.

    The amount all rows drop is trimmed; each row's remainder is rolled to the
    front as left padding, where the mask hides it, so every row's tokens end
    at the same index again (what mlx-lm's ``finalize`` does with right padding).
    Rows of a mixed batch accept different counts at nearly every drafting step,
    so this runs on most of them: one row gather per array (``_rolled``), not
    mlx-lm's element-wise ``dynamic_roll``, which cost more than a whole plain
    step (BENCHMARKS.md, "Speculative decoding", the realignment fix).
    """
    if any(drops) and not caches.droppable(cache):
        raise ValueError(
            "rejected draft tokens cannot be dropped from a sliding window's cache; serve this model with "
            "speculation off (neuron.models.architectures.limits_for turns it off)"
        )
    for state in cache:
        if isinstance(state, Recording):  # a linear-attention layer takes back each row's state (rank.states)
            state.drop(drops)
    cache = [layer for layer in cache if not isinstance(layer, Recording)]
    common = min(drops)
    rest = [d - common for d in drops]
    for layer in cache:
        if common:
            layer.trim(common)
    if not any(rest) or not cache or cache[0].keys is None:
        return
    shift = mx.array(rest)
    # The live length: where the next token is written (mlx-lm keeps it private; trim moved it).
    live = cache[0]._idx
    sources: dict[tuple[int, ...], mx.array] = {}
    for layer in cache:
        if isinstance(layer.keys, tuple):  # quantized (``rank.kv.quantized``): packed values, scales, biases alike
            layer.keys = tuple(_rolled(x, shift, live, sources) for x in layer.keys)
            layer.values = tuple(_rolled(x, shift, live, sources) for x in layer.values)
        else:
            layer.keys = _rolled(layer.keys, shift, live, sources)
            layer.values = _rolled(layer.values, shift, live, sources)
        layer.offset = layer.offset - shift
        layer.left_padding = layer.left_padding + shift


def _rolled(x: mx.array, shift: mx.array, live: int, sources: dict[tuple[int, ...], mx.array]) -> mx.array:
    """``x`` (batch, heads, capacity, dim) with row b's first ``live`` positions rolled right by ``shift[b]``.

    Each position is a contiguous ``dim`` vector, so this is one gather of whole vectors; the index, shared by
    every layer of the same shape, maps each destination to its source and leaves the spare capacity in place.
    """
    batch, heads, capacity, dim = x.shape
    key = (batch, heads, capacity)
    if key not in sources:
        position = mx.arange(capacity)[None, None, :]
        source = mx.where(position < live, (position - shift[:, None, None]) % live, position)
        rows = mx.arange(batch * heads).reshape(batch, heads, 1) * capacity
        sources[key] = (source + rows).reshape(-1)
    return mx.take(x.reshape(-1, dim), sources[key], axis=0).reshape(batch, heads, capacity, dim)
