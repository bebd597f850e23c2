"""A rank's prefix-cache entries: its own shard of each saved prompt's KV cache, by the leader's entry id.

The rank decides nothing here: the plan names every entry to save, restore or
evict, and the leader sized them all. A rank holds only its layers' share (its
slice of the key/value heads, or its pipeline stage's layers), and handles it
the same way either way. ``state`` goes into the rank's fingerprint, so a rank
whose entries differ from rank 0's is a desync on that very step.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from neuron.rpc import StepPlan

Layer = tuple[mx.array, mx.array]  # keys and values, [1, kv heads here, tokens, head dim]


class Entries:
    def __init__(self) -> None:
        self._held: dict[int, list[Layer]] = {}
        # Every held entry's (id, length), folded as it comes and goes: the fingerprint is taken every step, and
        # listing a full cache's entries each time would cost the step more the more the cache holds.
        self._digest = 0

    def __contains__(self, entry: int) -> bool:
        return entry in self._held

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._held))

    def length(self, entry: int) -> int:
        return self._held[entry][0][0].shape[2]

    def state(self) -> tuple[int, int]:
        """How many entries, and a digest of each one's id and length, for the fingerprint."""
        return len(self._held), self._digest

    def _fold(self, entry: int) -> None:
        """Add ``entry`` to the digest, or take it out again (an XOR: order does not matter)."""
        self._digest ^= hash((entry, self.length(entry)))  # ints hash alike in every process

    def disagreement(self, plan: StepPlan) -> str | None:
        """Why this rank's entries cannot follow ``plan``, or None."""
        for restore in plan.restore:
            if restore.entry not in self._held or self.length(restore.entry) < restore.tokens:
                return f"prefix entry {restore.entry} cannot give {restore.tokens} tokens: this rank lacks them"
        for evict in plan.evict:
            if evict.entry not in self._held:
                return f"prefix entry {evict.entry} cannot be evicted: this rank does not hold it"
        ending = {chunk.seq for chunk in plan.prefill if chunk.last}
        for save in plan.save:
            if save.entry in self._held or save.seq not in ending:
                return f"prefix entry {save.entry} cannot be saved from sequence {save.seq} here"
        return None

    def evict_and_save(self, plan: StepPlan, caches: dict[int, list[KVCache] | None]) -> None:
        """After the plan's prompts are fed: drop its evictions, then keep each prompt it saves (``caches``: the
        saved sequences' own caches)."""
        for evict in plan.evict:
            self._fold(evict.entry)
            del self._held[evict.entry]
        for save in plan.save:
            cache = caches[save.seq]
            assert cache is not None
            self._save(save.entry, cache)

    def _save(self, entry: int, cache: list[KVCache]) -> None:
        """Copy a sequence's cache, trimmed to what it holds (the buffer beyond its offset is slack)."""
        if not all(type(c) is KVCache for c in cache):
            raise ValueError(
                "a prefix-cache entry is restored cut back to a shared beginning, which a sliding window's or a "
                "linear-attention state's cache cannot be: serve this model with the prefix cache off "
                "(neuron.architectures.limits_for turns it off)"
            )
        layers = [
            (mx.contiguous(c.keys[..., : c.offset, :]), mx.contiguous(c.values[..., : c.offset, :])) for c in cache
        ]
        mx.eval(layers)
        self._held[entry] = layers
        self._fold(entry)

    def restore(self, entry: int, tokens: int) -> list[KVCache]:
        """A fresh cache per layer holding the entry's first ``tokens``; the entry itself is left as it was."""
        caches = []
        for keys, values in self._held[entry]:
            cache = KVCache()
            # The cache's next update sees a full buffer and concatenates into a new one, never writing here.
            cache.state = (keys[..., :tokens, :], values[..., :tokens, :], tokens)
            caches.append(cache)
        return caches

    def clear(self) -> None:
        self._held.clear()
        self._digest = 0
