"""A fair share per API key (``--api-key`` given more than once, ``--api-keys-file``): while requests of more than
one key are in flight, no key holds more than its share of the batch's places or of the waiting queue. Decisions
only, as the scheduler's: the order waiting requests are admitted in, the request a fair share refuses, and the
sequence preempted for a key under its share. No MLX, no I/O.

A key's share of the batch is taken by admitting, each time, the next request of the key that holds the fewest
places (its waiting ones in their own order), and by preempting the newest sequence of the key that holds the most
when the batch is full and a key under its share waits. With one key, or none, every function here leaves the
order of arrival (or of priority) as it is.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Collection, Iterable

from neuron.engine.sequence import Sequence


def keyed(seqs: Iterable[Sequence]) -> set[str | None]:
    """The keys ``seqs`` came with."""
    return {seq.key for seq in seqs}


def order(waiting: deque[Sequence], batch: Collection[Sequence], by_priority: bool) -> Iterable[Sequence]:
    """The waiting requests in the order admission takes them: as queued where they all came with one key; else,
    one at a time, the first waiting request of the key that would then hold the fewest places (under the priority
    policy, of the best priority waiting first), ties to the one queued first."""
    if len(keyed(waiting)) < 2:
        return waiting
    held = places(batch)
    by_key: dict[str | None, deque[tuple[int, Sequence]]] = {}
    for at, seq in enumerate(waiting):
        by_key.setdefault(seq.key, deque()).append((at, seq))
    out = []
    while by_key:

        def first(key: str | None) -> tuple[int, int, int]:
            at, seq = by_key[key][0]
            return (seq.priority if by_priority else 0, held[key], at)

        key = min(by_key, key=first)
        _, seq = by_key[key].popleft()
        out.append(seq)
        held[key] += seq.n
        if not by_key[key]:
            del by_key[key]
    return out


def places(batch: Iterable[Sequence]) -> Counter[str | None]:
    """The batch's places (its generating sequences) each key holds."""
    return Counter(seq.key for seq in batch if seq.pooling is None)


def queue_share(max_waiting: int, keys: int) -> int:
    """The requests one key may have waiting while ``keys`` keys have requests in flight."""
    return math.ceil(max_waiting / keys)


def refusal(seq: Sequence, waiting: Collection[Sequence], batch: Iterable[Sequence], max_waiting: int) -> str | None:
    """Why ``seq`` may not wait, or None: the queue is full (``--max-waiting``), or, while requests of other keys
    are in flight, its key already has its share of the queue's places waiting. A key under its share is queued
    even where the queue is full, so that a key that filled it alone never locks the others out."""
    keys = keyed(waiting) | keyed(batch) | {seq.key}
    if len(keys) < 2:
        if len(waiting) < max_waiting:
            return None
        return f"{len(waiting)} requests are already waiting (the limit); retry shortly"
    mine = sum(other.key == seq.key for other in waiting)
    if mine < queue_share(max_waiting, len(keys)):
        return None
    return (
        f"API key {seq.key!r} has {mine} requests waiting, its share of the queue's {max_waiting} places while "
        f"{len(keys) - 1} other key(s) have requests in flight; retry once some of them have started"
    )


def victim(head: Sequence, batch: Collection[Sequence], by_priority: bool) -> Sequence | None:
    """The sequence preempted so that ``head``, the next request admission takes, gets a place its key's share
    owes it: the newest admitted of the key that holds the most places, where it holds more than ``head``'s key
    would with ``head`` admitted (so the two never trade places back and forth); under the priority policy, never
    one of a better priority than ``head``'s. None where no key holds more than its share."""
    held = places(batch)
    candidates = [
        seq
        for seq in batch
        if seq.pooling is None and seq.key != head.key and not (by_priority and seq.priority < head.priority)
    ]
    if not candidates:
        return None
    most = max(keyed(candidates), key=lambda key: held[key])
    if held[most] <= held[head.key] + head.n:
        return None
    return max((seq for seq in candidates if seq.key == most), key=lambda seq: seq.admitted)
