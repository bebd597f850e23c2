"""Embedding inputs on one rank: fed as prompts are, and their final hidden states pooled on rank 0.

An input is a prompt that nothing is generated from: its chunks run through
the layers without the projection to the vocabulary, in a cache of its own
(never the batch's, never a prefix-cache entry), and rank 0 pools the final
hidden states (the final norm's output) as the plan's chunk says: ``MEAN``
over every position, summed chunk by chunk, or the ``LAST`` position's.
Scaled to unit length, as OpenAI's embeddings are. When its last chunk is fed
every rank drops it: no later plan names it.

Every input goes through on its own, so that its vector does not depend on
what else the step holds, and every rank issues the same collectives for the
same plan, as ``prefill.feed_prompts`` does.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from neuron.rpc import Prefill
from neuron.sampling_params import NOT_ASKED, Sampled
from neuron.tp import caches
from neuron.tp.prefill import SeqState
from neuron.tp.runner import Sharded, Stage

# torch's F.normalize guards a zero vector the same way: it stays zero instead of becoming NaN.
_NORM_FLOOR = 1e-12


def embed_inputs(
    runner: Sharded | Stage,
    model: nn.Module,
    seqs: dict[int, SeqState],
    chunks: list[Prefill],
    shadow: bool = False,
) -> dict[int, mx.array]:
    """Feed embedding chunks (``chunk.pool`` set); rank 0 returns the unit vector of each input that ends here.
    ``shadow`` runs the same shapes on throwaway caches and records nothing."""
    out: dict[int, mx.array] = {}
    for chunk in chunks:
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


def as_sampled(vectors: dict[int, mx.array]) -> dict[int, Sampled]:
    """Each input's vector on the host, as its step's outcome: float32, little-endian."""
    return {
        seq: Sampled(0, NOT_ASKED, embedding=np.asarray(vector, dtype="<f4").tobytes())
        for seq, vector in vectors.items()
    }
