"""Rank 0's head: one object, built once with the pool and handed to every step rank 0 runs, that turns logits into
tokens: a sampler per sequence (``rank.head.sampler``), and speculation's verdicts on drafted rows (a point-mass
``Run``, or rejection sampling against a draft model's distributions, ``rank.head.rejection``), with the draft
model or the model's own prediction layer that proposes them (``rank.head.drafter``, ``rank.head.mtp``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from neuron.rank.head.rejection import Rejection
from neuron.rank.head.sampler import Draw, Run, Sampler, Verdict, draw_all, read
from neuron.step import DraftRow, Sampled, Step

if TYPE_CHECKING:
    from neuron.rank.head.drafter import Drafter, Proposal
    from neuron.rank.head.mtp import MtpDrafter


class Head:
    """Rank 0's samplers, one per sequence, from the step that starts it until it leaves; and the draft model's
    proposals (``--draft-model``), which their rows are verified against."""

    def __init__(self) -> None:
        self._by_seq: dict[int, Sampler] = {}
        self.drafter: Drafter | MtpDrafter | None = None  # a draft model's, or the model's own prediction layer
        self._proposed: dict[int, Proposal] = {}  # the draft model's, for the next step

    def propose(self, rows: list[DraftRow]) -> dict[int, list[int]]:
        """The draft model's tokens for each row (``rank.head.drafter``); its distributions are kept for the step."""
        if self.drafter is None:
            raise RuntimeError("rank 0 has no draft model: the plan asked for drafts it cannot make")
        self._proposed = self.drafter.propose(rows)
        return {seq: proposal.tokens for seq, proposal in self._proposed.items()}

    def __len__(self) -> int:
        return len(self._by_seq)

    def step(self, step: Step, logits: dict[int, mx.array]) -> dict[int, Sampled]:
        """``draw`` then ``read``: the step's tokens on the host."""
        return read(*self.draw(step, logits))

    def draw(self, step: Step, logits: dict[int, mx.array]) -> tuple[dict[int, Draw], dict[int, Verdict]]:
        """Follow ``step`` (who leaves, who starts and how, what each prompt was fed), then draw a token from the
        logits of every sequence that has some, lazily; rows with a draft draw every position they were fed (``Run``).

        A sequence the step neither starts nor has started before is a bug upstream: it raises rather than sample
        with parameters nobody asked for."""
        plan = step.plan
        for seq in plan.leave:
            self._by_seq.pop(seq, None)
        if self.drafter is not None:
            for seq in plan.leave:
                self.drafter.held.pop(seq, None)
        proposed, self._proposed = self._proposed, {}
        for seq, start in step.starts.items():
            self._by_seq[seq] = Sampler(start.params, start.produced)
            self._by_seq[seq].feed(list(start.recent))
        fed = {c.seq for c in plan.prefill if not c.pool}  # an embedding input is never sampled
        if unknown := sorted((fed | {r.seq for r in plan.decode}) - self._by_seq.keys()):
            raise KeyError(f"rank 0 has no sampler for sequences {unknown}: the step neither starts nor continues them")
        for chunk in plan.prefill:
            if chunk.pool:
                continue
            sampler = self._by_seq[chunk.seq]
            sampler.feed(chunk.tokens)
            if chunk.scores and (rows := logits.pop(chunk.seq, None)) is not None:
                sampler.score(rows, chunk.tokens)
                if chunk.last:
                    logits[chunk.seq] = rows[-1]
                    logits.update(dict.fromkeys(chunk.copies, rows[-1]))
        runs: dict[int, Verdict] = {}
        for row in plan.decode:  # rows with a draft have one row of logits per position fed
            if row.draft and (rows := logits.pop(row.seq, None)) is not None:
                sampler = self._by_seq[row.seq]
                drafted = proposed.get(row.seq)
                q = drafted.q if drafted is not None and drafted.tokens[: len(row.draft)] == row.draft else None
                if q is not None and Rejection.applies(sampler):
                    # A sampled draft: rejection sampling against the distributions it was drawn from.
                    runs[row.seq] = Rejection.draw(sampler, rows, row.draft, q[: len(row.draft)])
                else:
                    runs[row.seq] = Run.draw(sampler, rows, row.draft)
        return draw_all(self._by_seq, logits), runs

    def clear(self) -> None:
        self._by_seq.clear()
        self._proposed = {}
        if self.drafter is not None:
            self.drafter.held.clear()
