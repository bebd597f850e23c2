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

from neuron.rank.kv import caches
from neuron.rpc import Decode

if TYPE_CHECKING:
    from neuron.rank.kv.sequence import SeqState


@dataclass(slots=True)
class MicroBatch:
    ids: list[int]  # its rows, in order
    cache: list[caches.Layer]  # batched, one per layer of this rank that keeps a cache


class Batch:
    def __init__(self) -> None:
        self.micro_batches: dict[int, MicroBatch] = {}

    def ids(self, micro_batch: int) -> list[int]:
        return self.micro_batches[micro_batch].ids if micro_batch in self.micro_batches else []

    def holds(self, seq: int) -> bool:
        return any(seq in g.ids for g in self.micro_batches.values())

    def state(self) -> list[tuple[int, list[int]]]:
        """Each micro-batch's rows, for the rank's fingerprint."""
        return [(g, self.micro_batches[g].ids) for g in sorted(self.micro_batches)]

    def leave(self, leaving: set[int]) -> None:
        for number, micro_batch in list(self.micro_batches.items()):
            keep = [i for i, s in enumerate(micro_batch.ids) if s not in leaving]
            if len(keep) == len(micro_batch.ids):
                continue
            if not keep:
                del self.micro_batches[number]
                continue
            micro_batch.ids = [micro_batch.ids[i] for i in keep]
            for layer in micro_batch.cache:
                layer.filter(keep)
            caches.mark_single_row(micro_batch.cache, len(keep) == 1)  # the filter shifted the padding rows shared away

    def join(self, micro_batch: int, seqs: list[int], own: list[list[caches.Layer]]) -> None:
        """Append ``seqs`` (with their own caches, one per layer) to ``micro_batch``, after its rows."""
        merged = caches.merge(own)
        if micro_batch not in self.micro_batches:
            self.micro_batches[micro_batch] = MicroBatch(list(seqs), merged)
            caches.mark_single_row(merged, len(seqs) == 1)
            return
        existing = self.micro_batches[micro_batch]
        caches.mark_single_row(existing.cache, False)
        for layer, new in zip(existing.cache, merged, strict=True):
            layer.extend(new)
        existing.ids += seqs

    def join_rows(self, rows: list[Decode], seqs: dict[int, SeqState]) -> None:
        """Move the sequences of ``rows`` (their prompts done) into their micro-batches, taking over their caches."""
        for micro_batch in sorted({row.micro_batch for row in rows}):
            joining = [row.seq for row in rows if row.micro_batch == micro_batch]
            own = [seqs[s].cache for s in joining]
            assert all(c is not None for c in own)
            self.join(micro_batch, joining, own)  # type: ignore[arg-type]
            for s in joining:
                seqs[s].cache = None

    def clear(self) -> None:
        self.micro_batches.clear()


def row_inputs(rows: list[Decode], width: int) -> list[list[int]]:
    """What each row of a micro-batch of ``width`` (``StepPlan.widths``) is fed: its token and draft, padded with
    its last token (rank 0 ignores the padding's logits; the next plan drops it)."""
    return [[row.token, *row.draft] + [(row.draft or [row.token])[-1]] * (width - 1 - len(row.draft)) for row in rows]
