"""The prefix index: which prompt beginnings every rank holds computed, as numbered entries; the leader's alone.

Why the leader owns it: each rank keeps its own part of an entry's KV cache,
and ranks that chose for themselves what to keep or drop would drift apart.
So only this index decides; the step plan tells every rank to restore, save or
evict an entry, and each rank's fingerprint lists the entries it holds, so a
rank that disagrees is caught on that step.

A trie over token ids: a lookup walks the prompt down it, and the deepest node
reached is the longest cached prefix, exact token for token. An entry is one
saved prompt; a lookup may restore only the first n tokens of one, or, where
the model's caches cannot be cut back (``exact``: a sliding window, a
linear-attention state), only a whole one: the entry's end must be a beginning
of the prompt, as the previous turn's prompt is of a chat's next one. Each LoRA
adapter has a trie of its own (the base model's is adapter 0's): the same tokens
leave other keys and values under another adapter, so no entry is shared. Sizes
come from ``bytes_per_token`` and ``bytes_per_entry`` (the leader computes
them from the model's shape and each rank's share), so the budget holds on
every rank without any measuring.

Pure Python, no MLX: the scheduler consults it, and it is tested directly.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    through: set[int] = field(default_factory=set)  # entries whose tokens pass through (or end at) this node
    ends: int | None = None  # the entry whose tokens end exactly here


@dataclass(frozen=True, slots=True)
class Hit:
    entry: int
    tokens: int  # the first ``tokens`` of the entry are the prompt's


@dataclass(frozen=True, slots=True)
class Stored:
    entry: int  # the new entry's id
    evicted: list[int]  # entries dropped to make room for it, or covered by it
    spilled: dict[int, list[int]] = field(default_factory=dict)  # of those, the ones made room for: their tokens


def disk_key(tokens: list[int]) -> str:
    """The name an entry of these tokens has on disk, the same on every rank and after a restart."""
    return hashlib.sha256(array("q", tokens).tobytes()).hexdigest()[:32]


class PrefixIndex:
    def __init__(self, budget: int, bytes_per_token: int, bytes_per_entry: int = 0, exact: bool = False) -> None:
        self.budget = budget  # bytes, the most any rank holds of each kind (``models.cache_bytes``)
        self.bytes_per_token = bytes_per_token
        self.bytes_per_entry = bytes_per_entry  # what an entry holds whatever its length: states, full windows
        self.exact = exact  # restore whole entries only
        self.bytes = 0
        self.evictions = 0
        self._roots: dict[int, _Node] = {}  # by LoRA adapter (0: the base model)
        self._entries: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, least recently used first
        self._adapter: dict[int, int] = {}  # id -> the adapter whose trie holds it
        self.pinned: set[int] = set()  # restored in the plan being run: never evicted under it
        self._next = 1
        # Entries read back from disk while serving (``reload``) made room by evicting others: every rank still
        # holds those until the next plan evicts them.
        self.deferred: list[Stored] = []

    @property
    def entries(self) -> dict[int, int]:
        """Each entry's id and length, as every rank must hold them."""
        return {entry: len(tokens) for entry, tokens in self._entries.items()}

    def lookup(self, prompt: list[int], adapter: int = 0) -> Hit | None:
        """The longest cached prefix of ``prompt`` under LoRA ``adapter`` that leaves at least one token to feed
        (``exact``: the longest whole entry); pinned until ``unpin``, and made most recently used."""
        hit = self._deepest(prompt, adapter)
        if hit is None:
            return None
        self._entries.move_to_end(hit.entry)
        self.pinned.add(hit.entry)
        return hit

    def reach(self, prompt: list[int], adapter: int = 0) -> int:
        """How many of ``prompt``'s tokens a lookup would restore now; nothing is pinned or made recently used."""
        hit = self._deepest(prompt, adapter)
        return 0 if hit is None else hit.tokens

    def _deepest(self, prompt: list[int], adapter: int) -> Hit | None:
        node, depth, hit = self._roots.get(adapter, _Node()), 0, None
        for token in prompt[:-1]:  # the last token is always fed: its logits are the first sample
            child = node.children.get(token)
            if child is None:
                break
            node, depth = child, depth + 1
            if not self.exact:
                hit = Hit(next(iter(node.through)), depth)
            elif node.ends is not None:
                hit = Hit(node.ends, depth)
        return hit

    def unpin(self) -> None:
        """The plan that restored the pinned entries has run."""
        self.pinned.clear()

    def store(self, prompt: list[int], adapter: int = 0) -> Stored | None:
        """Make ``prompt`` (fed under LoRA ``adapter``) an entry, evicting the least recently used to stay within
        the budget; None when it is cached already, or cannot fit even alone (an entry over the budget must not
        flush everything)."""
        size = self._size(len(prompt))
        if size > self.budget:
            return None
        node, covered = self._roots.setdefault(adapter, _Node()), []
        for token in prompt:
            node = node.children.get(token)  # type: ignore[assignment]
            if node is None:
                break
            if node.ends is not None:
                # A shorter entry this one contains can never be the better hit. It goes even when this plan
                # restores from it: every rank restores before it evicts, and the new entry holds the same tokens.
                covered.append(node.ends)
        else:
            if node.ends is not None or (node.through and not self.exact):  # the whole prompt lies on an entry's path
                self._entries.move_to_end(node.ends if node.ends is not None else next(iter(node.through)))
                return None
        # Chosen before anything is dropped: when pinned entries leave too little room, nothing is.
        evicted, freed = list(covered), sum(self._size(len(self._entries[e])) for e in covered)
        for entry, tokens in self._entries.items():
            if self.bytes - freed + size <= self.budget:
                break
            if entry not in self.pinned and entry not in covered:
                evicted.append(entry)
                freed += self._size(len(tokens))
        if self.bytes - freed + size > self.budget:
            return None
        # Written to disk (``engine.prefix_disk``): the base model's alone, as the files name no adapter.
        spilled = {e: self._entries[e] for e in evicted if e not in covered and self._adapter.get(e, 0) == 0}
        for entry in evicted:
            self._remove(entry)
        entry = self._next
        self._next += 1
        self._insert(entry, prompt, adapter)
        return Stored(entry, evicted, spilled)

    def add(self, tokens: list[int]) -> int | None:
        """Make ``tokens`` an entry of the base model where it fits beside the others without evicting any (an
        entry read back from disk); its id, or None."""
        if self.bytes + self._size(len(tokens)) > self.budget or len(tokens) < 2:
            return None
        entry = self._next
        self._next += 1
        self._insert(entry, tokens, 0)
        return entry

    def reload(self, tokens: list[int]) -> Stored | None:
        """Make ``tokens`` (an entry of the base model read back from disk while serving) an entry, evicting the
        least recently used to stay within the budget; those evictions wait in ``deferred`` for the next plan.
        None when it cannot fit."""
        stored = self.store(tokens)
        if stored is not None:
            self.deferred.append(stored)
        return stored

    def shrink(self, budget: int) -> None:
        """Hold at most ``budget`` bytes from now on (the memory budget's share the batch leaves): the least recently
        used entries not pinned are evicted until the others fit, and wait in ``deferred`` for the next plan."""
        self.budget = budget
        evicted = []
        freed = 0
        for entry, tokens in self._entries.items():
            if self.bytes - freed <= budget:
                break
            if entry not in self.pinned:
                evicted.append(entry)
                freed += self._size(len(tokens))
        if not evicted:
            return
        spilled = {e: self._entries[e] for e in evicted if self._adapter.get(e, 0) == 0}
        for entry in evicted:
            self._remove(entry)
        self.deferred.append(Stored(0, evicted, spilled))  # 0: no entry was stored in their place

    def fresh(self) -> int:
        """A new entry id for an entry that goes straight to disk (a preempted sequence's caches), never held here."""
        entry = self._next
        self._next += 1
        return entry

    @property
    def tokens_held(self) -> int:
        return sum(len(tokens) for tokens in self._entries.values())

    def tokens(self, entry: int) -> list[int]:
        return self._entries[entry]

    def forget(self, entry: int) -> None:
        """An entry ``reload`` made that no rank holds after all (some rank failed to read its file)."""
        self._remove(entry)
        self.evictions -= 1

    def held(self) -> dict[int, list[int]]:
        """Every base-model entry's tokens, least recently used first (what the disk tier may keep: its files name
        no LoRA adapter, so an adapter's entries are never written)."""
        return {entry: tokens for entry, tokens in self._entries.items() if self._adapter.get(entry, 0) == 0}

    def clear(self) -> None:
        """Every rank's entries were cleared (a failed step, a desync, a probe)."""
        self._roots.clear()
        self._adapter.clear()
        self._entries.clear()
        self.pinned.clear()
        self.deferred.clear()
        self.bytes = 0

    def reshape(self, bytes_per_token: int, bytes_per_entry: int) -> None:
        """The group shrank: an entry costs the rank holding the largest share what the smaller group's shares hold.
        Every rank's entries went with the group it left."""
        self.clear()
        self.bytes_per_token = bytes_per_token
        self.bytes_per_entry = bytes_per_entry

    def _insert(self, entry: int, prompt: list[int], adapter: int) -> None:
        node = self._roots.setdefault(adapter, _Node())
        self._adapter[entry] = adapter
        for token in prompt:
            node = node.children.setdefault(token, _Node())
            node.through.add(entry)
        node.ends = entry
        self._entries[entry] = list(prompt)
        self.bytes += self._size(len(prompt))

    def _remove(self, entry: int) -> None:
        tokens = self._entries.pop(entry)
        self.bytes -= self._size(len(tokens))
        self.evictions += 1
        node = self._roots[self._adapter.pop(entry)]
        for token in tokens:
            child = node.children[token]
            child.through.discard(entry)
            if not child.through:
                del node.children[token]  # nothing else passes below here
                return
            node = child
        if node.ends == entry:
            node.ends = None

    def _size(self, tokens: int) -> int:
        return tokens * self.bytes_per_token + self.bytes_per_entry
