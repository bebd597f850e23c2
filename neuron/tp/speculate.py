"""Speculative decoding on the ranks: dropping what a row did not accept, and rank 0's verification.

Each decode row is fed ``[token] + draft`` (padded to its micro-batch's width)
in one batched forward. Rank 0 samples every position in order with the row's
own sampler and keeps the draft tokens while each sampled token equals the
draft's: a point-mass proposal, so this is exact rejection sampling (the token
kept at each position is a draw from the target distribution given the tokens
kept before it), and the random key is split once per kept token, so a seeded
request draws the same tokens with speculation on or off. The next plan tells
every rank how many tokens of the row to drop from its cache (``Decode.drop``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from neuron.rpc import Decode
from neuron.sampling_params import NOT_ASKED, Sampled

if TYPE_CHECKING:
    from neuron.tp.sampler import Sampler


def drop_tail(cache: list[BatchKVCache], drops: list[int]) -> None:
    """Drop ``drops[i]`` tokens from the end of row i in every layer: the rows drop different amounts.

    The amount all rows drop is trimmed; each row's remainder is rolled to the
    front as left padding, where the mask hides it, so every row's tokens end
    at the same index again (what mlx-lm's ``finalize`` does with right padding).
    Rows of a mixed batch accept different counts at nearly every drafting step,
    so this runs on most of them: one row gather per array (``_rolled``), not
    mlx-lm's element-wise ``dynamic_roll``, which cost SmolLM2 at batch 8 about
    100 ms a step on 2 CPU cores (a plain step is 95), against 18.
    """
    if any(drops) and not all(type(layer) is BatchKVCache for layer in cache):
        raise ValueError(
            "rejected draft tokens cannot be dropped from a sliding window's or a linear-attention state's cache; "
            "serve this model with speculation off (neuron.architectures.limits_for turns it off)"
        )
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


def verify(sampler: Sampler, logits: mx.array, draft: list[int]) -> list[Sampled]:
    """The tokens kept from a row fed ``[token] + draft``: ``logits`` holds its ``len(draft) + 1`` positions.

    Each position is sampled as plain decoding would sample it; the run stops at
    the first token that differs from the draft (that token is kept: it is the
    sample at that position), or after the bonus token past a fully kept draft.
    """
    out = []
    if sampler.plain:  # greedy and nothing else: one argmax for every position
        tokens = mx.argmax(logits, axis=-1).tolist()
        for i, token in enumerate(tokens):
            out.append(sampler.record(Sampled(int(token), NOT_ASKED)))
            if i == len(draft) or token != draft[i]:
                break
        return out
    for i in range(len(draft) + 1):
        out.append(sampler(logits[i]))
        if i == len(draft) or out[-1].token != draft[i]:
            break
    return out


def fed(rows: list[Decode]) -> list[list[int]]:
    """What each row of a micro-batch is fed: its token and draft, padded to the longest with its last token
    (rank 0 ignores the padding's logits; the next plan drops it)."""
    width = max(1 + len(row.draft) for row in rows)
    return [[row.token, *row.draft] + [(row.draft or [row.token])[-1]] * (width - 1 - len(row.draft)) for row in rows]
