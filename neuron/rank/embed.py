"""Embedding inputs on one rank: fed as prompts are, and their final hidden states pooled on rank 0.

An input is a prompt that nothing is generated from: its chunks run through
the layers without the projection to the vocabulary, in a cache of its own
(never the batch's, never a prefix-cache entry), and rank 0 pools the final
hidden states (the final norm's output) as the plan's chunk says: ``MEAN``
over every position, summed chunk by chunk, or the ``LAST`` position's.
Scaled to unit length, as OpenAI's embeddings are. When its last chunk is fed
every rank drops it: no later plan names it.

Inputs that start and end in the step go through together, left-padded into
one batch (a few batches, by length, so that padding never costs more than
the tokens themselves), where every cache of the model can take left padding;
the others one by one, chunk after chunk. The grouping depends on the plan
alone, so every rank issues the same collectives, as ``prefill.feed_prompts``
does.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from neuron.rank.kv import caches
from neuron.rank.kv.sequence import SeqState
from neuron.rank.runner import Sliced, Stage
from neuron.rpc import Prefill
from neuron.step import NOT_ASKED, Sampled

# torch's F.normalize guards a zero vector the same way: it stays zero instead of becoming NaN.
_NORM_FLOOR = 1e-12


def embed_inputs(
    runner: Sliced | Stage,
    model: nn.Module,
    seqs: dict[int, SeqState],
    chunks: list[Prefill],
    shadow: bool = False,
    together: bool = True,
) -> dict[int, mx.array]:
    """Feed embedding chunks (``chunk.pool`` set); rank 0 returns the unit vector of each input that ends here.
    ``shadow`` runs the same shapes on throwaway caches and records nothing; ``together`` false (a model with a
    cache that cannot take left padding) feeds every input on its own."""
    out: dict[int, mx.array] = {}
    whole = [chunk for chunk in chunks if chunk.position == 0 and chunk.last and together]
    for group in _groups(whole):
        out.update(_embed_together(runner, caches.fresh(model), group))
    for chunk in chunks:
        if chunk.position == 0 and chunk.last and together:
            continue
        if shadow or chunk.position == 0:
            state = SeqState(cache=caches.fresh(model))
            if not shadow:
                seqs[chunk.seq] = state
        else:
            state = seqs[chunk.seq]
        assert state.cache is not None
        tokens = mx.array(chunk.tokens)[None]
        mean = chunk.pool == "MEAN"
        states = None
        if mean or chunk.last:
            states = runner.states(tokens, state.cache, every=mean)
        else:
            runner.feed(tokens, state.cache)
        state.position += len(chunk.tokens)
        state.last = chunk.tokens[-1]
        if states is not None and mean:
            total = states[0].astype(mx.float32).sum(axis=0)
            state.pooled = total if state.pooled is None else state.pooled + total
            mx.eval(state.pooled)
        if not chunk.last:
            continue
        if not shadow:
            del seqs[chunk.seq]
        if states is not None:
            # The mean's division is left out: scaling to unit length undoes it.
            vector = state.pooled if mean and state.pooled is not None else states[0, -1].astype(mx.float32)
            out[chunk.seq] = vector / mx.maximum(mx.linalg.norm(vector), _NORM_FLOOR)
    return out


def _groups(whole: list[Prefill]) -> list[list[Prefill]]:
    """Whole inputs in batches of one pooling each, by length, each padded to its longest at most to twice the
    tokens it holds."""
    groups: list[list[Prefill]] = []
    for pool in sorted({chunk.pool for chunk in whole}):
        group: list[Prefill] = []
        for chunk in sorted((c for c in whole if c.pool == pool), key=lambda c: (len(c.tokens), c.seq)):
            tokens = sum(len(c.tokens) for c in group) + len(chunk.tokens)
            if group and (len(group) + 1) * len(chunk.tokens) > 2 * tokens:
                groups.append(group)
                group = []
            group.append(chunk)
        groups.append(group)
    return [group for group in groups if group]


def _embed_together(runner: Sliced | Stage, fresh: list[caches.Layer], group: list[Prefill]) -> dict[int, mx.array]:
    """One forward over inputs left-padded to the longest, in caches of ``fresh``'s kinds (quantized with
    ``--kv-bits``, as an input fed alone); rank 0 pools each over its own positions."""
    width = max(len(chunk.tokens) for chunk in group)
    pads = [width - len(chunk.tokens) for chunk in group]
    batched = caches.padded_batch(fresh, pads)
    tokens = mx.array([[0] * pad + chunk.tokens for pad, chunk in zip(pads, group, strict=True)])
    mean = group[0].pool == "MEAN"
    states = runner.states(tokens, batched, every=mean)
    if states is None:
        return {}
    if mean:  # the padding's states are left out (where, not a product: they may be NaN, attending to nothing)
        real = mx.arange(width)[None, :] >= mx.array(pads)[:, None]
        vectors = mx.where(real[..., None], states.astype(mx.float32), 0.0).sum(axis=1)
    else:
        vectors = states[:, -1].astype(mx.float32)
    vectors = vectors / mx.maximum(mx.linalg.norm(vectors, axis=-1, keepdims=True), _NORM_FLOOR)
    return {chunk.seq: vectors[i] for i, chunk in enumerate(group)}


def as_sampled(vectors: dict[int, mx.array]) -> dict[int, Sampled]:
    """Each input's vector on the host, as its step's outcome: float32, little-endian."""
    return {
        seq: Sampled(0, NOT_ASKED, embedding=np.asarray(vector, dtype="<f4").tobytes())
        for seq, vector in vectors.items()
    }
