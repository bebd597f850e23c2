"""Admission: which waiting requests join the batch, in arrival order (with requests of several API keys waiting,
in the order their fair share gives: ``engine.fairness``), while it has places (``--max-batch``) and
the memory budget room for each one's reservation (``engine.memory``). Decisions only, as the scheduler's, whose
queues it reads and fills. Which sequences of the batch step out for memory as it grows is the scheduler's own
check of every step (``Scheduler._fit``, by ``memory.overflow``).

First come, first served: one that waits for memory holds back those behind it, so that a long request is never
starved by short ones. An embedding request holds no place (its inputs are fed and leave, and no decode row is
theirs), so it is admitted past a generation that waits for a place: that one gets the next place all the same.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from neuron.config.settings import Scheduling
from neuron.engine import fairness, memory
from neuron.engine.memory import Budget
from neuron.engine.sequence import Sequence, Status


class Admission:
    def __init__(
        self,
        limits: Scheduling,
        budget: Budget | None,
        waiting: deque[Sequence],
        filling: list[Sequence],
        running: list[Sequence],
    ) -> None:
        self.limits = limits
        self.budget = budget  # None: places alone decide (the scheduler's own tests)
        # The scheduler's queues, read here, and ``admit`` moves sequences from the first to the second.
        self.waiting, self.filling, self.running = waiting, filling, running
        self.admissions = 0  # sequences admitted so far: each one's ``admitted``, the newest preempted first

    def order(self) -> Iterable[Sequence]:
        """The waiting requests in the order ``admit`` takes them (``fairness.order``)."""
        by_priority = self.limits.scheduling_policy == "priority"
        return fairness.order(self.waiting, [*self.filling, *self.running], by_priority)

    def admissible(self) -> list[Sequence]:
        """The waiting requests ``admit`` takes now, in the order it takes them (``order``)."""
        out = []
        places = len(self.running) + sum(seq.pooling is None for seq in self.filling)
        rows = self.rows()
        blocked = False
        for seq in self.order():
            if seq.pooling is None:
                blocked = blocked or places + seq.n > self.limits.max_batch
                if blocked:
                    continue
            if self.budget is not None:
                if (joined := memory.admitted(self.budget, rows, members(seq))) is None:
                    break
                rows = joined
            if seq.pooling is None:
                places += seq.n
            out.append(seq)
        return out

    def admit(self) -> list[Sequence]:
        """Move the admissible requests into the batch (their prompts to be fed), each with its reservation and
        its order among admissions; returns them, and the copies and inputs admitted with them."""
        admitted: list[Sequence] = []
        for seq in self.admissible():
            self.waiting.remove(seq)
            joining = members(seq)
            for member in joining:
                member.status = Status.FILLING
                member.reserved = memory.reservation(member)
                self.admissions += 1
                member.admitted = self.admissions
            self.filling += joining
            admitted += joining
        return admitted

    def drop_stuck(self) -> list[Sequence]:
        """Take out the request at the head of the queue where nothing is admitted and it does not fit the budget
        even alone (the budget shrank after it was taken in): nothing would ever make room for it. Returns it."""
        if self.budget is None or self.filling or self.running or not self.waiting:
            return []
        head = self.waiting[0]
        if memory.admitted(self.budget, self.rows(), members(head)) is not None:
            return []
        self.waiting.popleft()
        head.status = Status.FINISHED_ERROR
        return [head]

    def rows(self) -> list[list[int]]:
        """The batch's rows by micro-batch, as the tokens each one's caches may hold by the end of the next step."""
        return memory.rows_by_micro_batch(self.filling, self.running, self.limits.micro_batches)


def members(seq: Sequence) -> list[Sequence]:
    """Who is admitted with ``seq``: its copies (``n`` > 1) and its request's other embedding inputs, unless it is
    fed on its own since a pause."""
    return [seq] if seq.alone else [seq, *seq.copies, *seq.group]
