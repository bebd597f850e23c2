"""A rank's prefix-cache entries: its own part of each saved prompt's KV cache, by the leader's entry id.

The rank decides nothing here: the plan names every entry to save, restore or
evict, and the leader sized them all. A rank holds only its layers' share (its
slice of the key/value heads, or its pipeline stage's layers), and handles it
the same way either way. ``state`` goes into the rank's fingerprint, so a rank
whose entries differ from rank 0's is a desync on that very step.

A plain key/value layer is kept as its keys and values (each quantized, as
packed values, scales and biases, with ``--kv-bits``), and restores any first
part of them. Any other layer (a sliding window's rotating cache, a
linear-attention state) is kept whole as it stood at the prompt's end: a
snapshot, which restores that one boundary and no other (the leader's index
then restores only at an entry's end: ``PrefixIndex(exact=True)``). Either
kind goes to disk and comes back alike (``rank.kv.disk``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from neuron.models.folder import KV_GROUP_SIZE
from neuron.rank.kv import caches
from neuron.rank.kv.disk import Disk, DiskError, KeysValues, Stored, log
from neuron.rpc import StepPlan

if TYPE_CHECKING:
    from neuron.rank.kv.batch import Batch
    from neuron.rank.kv.sequence import SeqState


@dataclass(frozen=True, slots=True)
class _Entry:
    tokens: int  # the prompt's length
    layers: list[KeysValues | caches.Layer]  # per layer: keys and values, or a snapshot of any other cache

    @property
    def cuttable(self) -> bool:
        return all(isinstance(layer, tuple) for layer in self.layers)


class Entries:
    def __init__(self) -> None:
        self._held: dict[int, _Entry] = {}
        self.disk: Disk | None = None  # where spilled entries go (``OpenPrefixDisk``); None: they are dropped
        self.kv_bits: int | None = None  # the bits plain layers are quantized to (``--kv-bits``); None: not
        # How many entries, and every held entry's (id, length) folded as it comes and goes, for the fingerprint:
        # it is taken every step, and listing a full cache's entries each time would cost the step more the more
        # the cache holds.
        self.state = (0, 0)
        self.nbytes = 0  # what the held entries take, counted as they come and go (the rank's memory reading)

    def __contains__(self, entry: int) -> bool:
        return entry in self._held

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._held))

    def length(self, entry: int) -> int:
        return self._held[entry].tokens

    def _fold(self, entry: int, tokens: int) -> None:
        """Add an entry that came to the digest, or take out one that went (an XOR: order does not matter)."""
        self.state = (len(self._held), self.state[1] ^ hash((entry, tokens)))  # ints hash alike in every process

    def _hold(self, entry: int, held: _Entry) -> None:
        self._held[entry] = held
        self._fold(entry, held.tokens)
        self.nbytes += caches.nbytes(held.layers)

    def _drop(self, entry: int) -> _Entry:
        gone = self._held.pop(entry)
        self._fold(entry, gone.tokens)
        self.nbytes -= caches.nbytes(gone.layers)
        return gone

    def disagreement(self, plan: StepPlan) -> str | None:
        """Why this rank's entries cannot follow ``plan``, or None."""
        for restore in plan.restore:
            held = self._held.get(restore.entry)
            if held is None or held.tokens < restore.tokens:
                return f"prefix entry {restore.entry} cannot give {restore.tokens} tokens: this rank lacks them"
            if held.tokens != restore.tokens and not held.cuttable:
                return (
                    f"prefix entry {restore.entry} holds a snapshot of {held.tokens} tokens, which cannot be cut "
                    f"back to {restore.tokens}"
                )
        leaving_saved = {save.entry for save in plan.save if save.tokens}  # saved before the evictions: to disk
        for evict in plan.evict:
            if evict.entry not in self._held and evict.entry not in leaving_saved:
                return f"prefix entry {evict.entry} cannot be evicted: this rank does not hold it"
        ending = {chunk.seq for chunk in plan.prefill if chunk.last}
        leaving = set(plan.leave)
        for save in plan.save:
            if save.entry in self._held or save.seq not in (leaving if save.tokens else ending):
                return f"prefix entry {save.entry} cannot be saved from sequence {save.seq} here"
        return None

    def disagreement_leaving(self, plan: StepPlan, seqs: Mapping[int, SeqState], batch: Batch) -> str | None:
        """Why this rank cannot keep the plan's leaving sequences it saves, or None."""
        for save in plan.save:
            if not save.tokens:
                continue
            state = seqs.get(save.seq)
            if state is None or not batch.holds(save.seq) or state.position < save.tokens:
                return f"sequence {save.seq} cannot be saved with {save.tokens} tokens: this rank does not hold them"
            rows = next(g for g in batch.micro_batches.values() if save.seq in g.ids)
            if not caches.cuttable(rows.cache):
                return f"sequence {save.seq} cannot be saved as it leaves: its caches cannot be cut to {save.tokens}"
        return None

    def save_leaving(self, plan: StepPlan, batch: Batch) -> None:
        """Before the plan's leaving sequences are dropped: keep the first ``tokens`` of each one it saves (its
        prompt and the output it was fed; a rejected draft's tail, not yet dropped, lies past them)."""
        for save in plan.save:
            if not save.tokens:
                continue
            rows = next(g for g in batch.micro_batches.values() if save.seq in g.ids)
            row = rows.ids.index(save.seq)
            layers: list[KeysValues | caches.Layer] = []
            for layer in rows.cache:
                start = int(layer.left_padding[row].item())
                end = start + save.tokens
                layers.append((_cut(layer.keys, row, start, end), _cut(layer.values, row, start, end)))
            mx.eval(layers)
            self._hold(save.entry, _Entry(save.tokens, layers))

    def evict_and_save(self, plan: StepPlan, seqs: Mapping[int, SeqState]) -> None:
        """After the plan's prompts are fed: drop its evictions, then keep each prompt it saves (from ``seqs``,
        the rank's sequences, their prompts just fed)."""
        for evict in plan.evict:
            gone = self._drop(evict.entry)
            if evict.key and self.disk is not None:
                self.disk.spill(evict.key, gone.tokens, gone.layers)
        for save in plan.save:
            if save.tokens:  # kept as it left (``save_leaving``)
                continue
            state = seqs[save.seq]
            assert state.cache is not None
            self._hold(save.entry, _kept(state.cache, state.position))

    def restore(self, entry: int, tokens: int) -> list[caches.Layer]:
        """A fresh cache per layer holding the entry's first ``tokens`` (all of them where it holds a snapshot);
        the entry itself is left as it was."""
        restored: list[caches.Layer] = []
        for layer in self._held[entry].layers:
            if isinstance(layer, tuple):
                keys, values = layer
                # The cache's next update sees a full buffer and concatenates into a new one, never writing here.
                if isinstance(keys, tuple):
                    assert self.kv_bits is not None and isinstance(values, tuple)
                    quantized = QuantizedKVCache(KV_GROUP_SIZE, self.kv_bits)
                    quantized.state = (
                        _first(keys, tokens),
                        _first(values, tokens),
                        tokens,
                        KV_GROUP_SIZE,
                        self.kv_bits,
                    )
                    restored.append(quantized)
                    continue
                assert not isinstance(values, tuple)
                cache = KVCache()
                cache.state = (keys[..., :tokens, :], values[..., :tokens, :], tokens)
                restored.append(cache)
            else:
                restored.extend(caches.copied([layer]))
        return restored

    def clear(self) -> None:
        self._held.clear()
        self.state = (0, 0)
        self.nbytes = 0

    def load(self, entries: dict[str, int], drop: Collection[int] = ()) -> list[str]:
        """Drop the entries ``drop`` names where held (another rank failed to load them), then load the files
        ``entries`` names (key -> entry id) as entries; returns the keys that failed, each warned of and not
        loaded."""
        for entry in drop:
            if entry in self._held:
                self._drop(entry)
        if not entries:
            return []
        assert self.disk is not None
        failed = []
        for key, entry in entries.items():
            try:
                tokens, layers = self.disk.load(key)
            except (DiskError, OSError) as e:
                log.warning("prefix cache file skipped", key=key, reason=str(e))
                failed.append(key)
                continue
            self._hold(entry, _Entry(tokens, layers))
        return failed


def _kept(cache: list[caches.Layer], tokens: int) -> _Entry:
    """A copy of a sequence's caches: a plain layer trimmed to what it holds (the buffer beyond its offset is
    slack), any other whole, with arrays of its own (the sequence goes on writing into its own)."""
    layers: list[KeysValues | caches.Layer] = []
    for layer in cache:
        if type(layer) in (KVCache, QuantizedKVCache):
            assert layer.keys is not None and layer.values is not None
            layers.append((_cut(layer.keys, 0, 0, layer.offset), _cut(layer.values, 0, 0, layer.offset)))
        else:
            layers.extend(caches.copied([layer]))
    mx.eval([layer if isinstance(layer, tuple) else caches.arrays(layer) for layer in layers])
    return _Entry(tokens, layers)


def _cut(held: Stored, row: int, start: int, end: int) -> Stored:
    """Row ``row``'s positions ``[start, end)`` of keys or values, plain or quantized, in arrays of their own."""
    if isinstance(held, tuple):
        a, b, c = (mx.contiguous(x[row : row + 1, :, start:end]) for x in held)
        return a, b, c
    return mx.contiguous(held[row : row + 1, :, start:end])


def _first(held: tuple[mx.array, mx.array, mx.array], tokens: int) -> tuple[mx.array, mx.array, mx.array]:
    a, b, c = (x[..., :tokens, :] for x in held)
    return a, b, c
