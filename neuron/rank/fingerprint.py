"""A digest of what a rank holds, sent back with every step: the leader compares every worker's with rank 0's,
and a difference is a desync named by rank."""

from __future__ import annotations

import hashlib

from neuron.rank.kv.batch import Batch
from neuron.rank.kv.entries import Entries
from neuron.rank.prefill import SeqState


def fingerprint(batch: Batch, seqs: dict[int, SeqState], entries: Entries) -> str:
    """Each micro-batch's rows in order, every sequence's position and last token, and the prefix-cache entries'
    ids and lengths."""
    state = [
        batch.state(),
        sorted((s, q.position, q.last, q.prompt_done) for s, q in seqs.items()),
        entries.state(),
    ]
    return hashlib.blake2b(repr(state).encode(), digest_size=8).hexdigest()
