"""The sequences a rank decodes, in the micro-batches the plan names, each with its batched KV caches.

Why micro-batches: in a pipeline, a stage that gets the whole batch at once
leaves every other stage idle while it works. Split in two, stage 1 works on
the first half while rank 0 works on the second (``runner.Stage.logits``).
The plan says which micro-batch a sequence joins, so every rank, a desynced
one too, runs passes of the same shapes. Tensor parallelism uses one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from neuron.rpc import Decode
from neuron.tp import caches

if TYPE_CHECKING:
    from neuron.tp.prefill import SeqState


@dataclass(slots=True)
class MicroBatch:
    ids: list[int]  # its rows, in order
    cache: list[caches.Layer]  # batched, one per layer of this rank that keeps a cache


class Batch:
    def __init__(self) -> None:
        self.groups: dict[int, MicroBatch] = {}

    def ids(self, group: int) -> list[int]:
        return self.groups[group].ids if group in self.groups else []

    def holds(self, seq: int) -> bool:
        return any(seq in g.ids for g in self.groups.values())

    def state(self) -> list[tuple[int, list[int]]]:
        """Each micro-batch's rows, for the rank's fingerprint."""
        return [(g, self.groups[g].ids) for g in sorted(self.groups)]

    def leave(self, leaving: set[int]) -> None:
        for number, group in list(self.groups.items()):
            keep = [i for i, s in enumerate(group.ids) if s not in leaving]
            if len(keep) == len(group.ids):
                continue
            if not keep:
                del self.groups[number]
                continue
            group.ids = [group.ids[i] for i in keep]
            for layer in group.cache:
                layer.filter(keep)

    def join(self, group: int, seqs: list[int], own: list[list[caches.Layer]]) -> None:
        """Append ``seqs`` (with their own caches, one per layer) to micro-batch ``group``, after its rows."""
        merged = caches.merge(own)
        if group not in self.groups:
            self.groups[group] = MicroBatch(list(seqs), merged)
            return
        existing = self.groups[group]
        for layer, new in zip(existing.cache, merged, strict=True):
            layer.extend(new)
        existing.ids += seqs

    def join_rows(self, rows: list[Decode], seqs: dict[int, SeqState]) -> None:
        """Move the sequences of ``rows`` (their prompts done) into their micro-batches, taking over their caches."""
        for group in sorted({row.group for row in rows}):
            joining = [row.seq for row in rows if row.group == group]
            own = [seqs[s].cache for s in joining]
            assert all(c is not None for c in own)
            self.join(group, joining, own)  # type: ignore[arg-type]
            for s in joining:
                seqs[s].cache = None

    def clear(self) -> None:
        self.groups.clear()
