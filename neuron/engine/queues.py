"""Where the engine's sequences are: waiting in the queue, filling (admitted, their prompts being fed), running
(decoding), and who leaves every rank in the next plan; the moves between those places, each made here once. The
scheduler decides each move (``engine.scheduler``, ``engine.admission``); nothing here decides. No MLX, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from typing import NamedTuple

from neuron.config.settings import Scheduling
from neuron.engine import fairness
from neuron.engine.prefix import PrefixIndex
from neuron.engine.refusals import Overloaded
from neuron.engine.sequence import Pause, Sequence, Status


class BatchPaused(NamedTuple):
    """What a lost group did to the batch (``Queues.pause``)."""

    paused: list[Sequence]  # back in the queue, to be fed again
    given_up: list[Sequence]  # blamed for too many losses
    cancelled: list[tuple[Sequence, int]]  # their callers had gone: they just leave


class Queues:
    def __init__(self, limits: Scheduling, prefix: PrefixIndex | None) -> None:
        self.limits = limits
        self.prefix = prefix  # None: no prefix cache
        self.waiting: deque[Sequence] = deque()
        self.filling: list[Sequence] = []  # admitted, prompt being fed
        self.running: list[Sequence] = []  # decoding, in batch order
        self.leaving: list[int] = []  # sequences every rank drops in the next plan
        self.stopping: list[Sequence] = []  # ended by the output path (a stop string): they leave at ``schedule``
        self.keeping: list[Sequence] = []  # leaving while decoding: the next plan saves each to the prefix cache
        # Preempted while decoding, with a disk tier: the next plan writes each one's caches there (its tokens).
        self.parking: list[tuple[int, list[int]]] = []
        self.spill = False  # whether entries evicted from memory are written to disk (``--prefix-cache-dir``)
        self.steps = 0  # steps applied (``Scheduler.update``); a cancellation is measured against it

    @property
    def batch(self) -> tuple[Sequence, ...]:
        """Every admitted sequence: prompts being fed, then the decoding ones."""
        return (*self.filling, *self.running)

    @property
    def pending(self) -> int:
        return len(self.waiting) + len(self.filling) + len(self.running)

    # Requests, taken up by the next ``Scheduler.schedule``.

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` behind the others (under the priority policy, behind those of its priority or better), or
        refuse it when the queue is full, or its API key has its share of the queue waiting (``fairness.refusal``)."""
        if (why := fairness.refusal(seq, self.waiting, self.batch, self.limits.max_waiting)) is not None:
            raise Overloaded(why)
        seq.status = Status.WAITING
        if self.by_priority:
            self.waiting.insert(_behind(self.waiting, lambda w: w.priority <= seq.priority), seq)
        else:
            self.waiting.append(seq)

    @property
    def by_priority(self) -> bool:
        return self.limits.scheduling_policy == "priority"

    def cancel(self, seq: Sequence) -> bool:
        """Mark ``seq`` as abandoned by its caller; True when it was still queued and has left at once (an
        admitted one leaves at the next ``schedule``)."""
        if seq.finished or seq.cancelled_at is not None:
            return False
        seq.cancelled_at = self.steps
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.status = Status.FINISHED_ABORTED
            return True
        return False

    def finish(self, seq: Sequence, produced: int) -> None:
        """The output path found a stop string in ``seq``'s text after its ``produced``-th token: it ends there
        (the tokens after it, drawn in the same step, are not its output), and leaves at the next ``schedule``."""
        del seq.output[produced:]
        seq.completion_tokens = min(seq.completion_tokens, produced)
        if not seq.status.finished:
            self.stopping.append(seq)
        seq.status = Status.FINISHED_STOPPED

    def remove(self, seq: Sequence, status: Status) -> None:
        """Take ``seq`` out of the batch; the ranks drop it in the next plan, if any of its prompt reached them."""
        if not seq.status.finished:
            seq.status = status
        for place in (self.filling, self.running):
            if seq in place:
                place.remove(seq)
                if seq.fed:
                    self.leaving.append(seq.no)
                if place is self.running and self.prefix is not None and not self.prefix.exact:
                    self.keeping.append(seq)

    def preempt(self, seq: Sequence, pause: Pause) -> None:
        """Pause ``seq`` with its stream open (``pause`` says why): every rank drops it (its caches written to the
        disk tier first, where one is set), and it waits at the front of the queue, behind those admitted before
        it, to be fed its prompt and output so far again, as a sequence a lost group paused is (``pause``)."""
        if seq in self.running:
            self.running.remove(seq)
            prefix = self.prefix
            if self.spill and prefix is not None and not prefix.exact and not seq.adapter and not seq.images:
                held = min(seq.held, len(seq.prompt) + len(seq.output))
                self.parking.append((seq.no, [*seq.prompt, *seq.output][:held]))
        else:
            self.filling.remove(seq)
        if seq.fed:
            self.leaving.append(seq.no)
        for copy in seq.fed_with:  # its copies waited for its prompt's end: each is fed on its own now
            copy.alone = True
        _replay_later(seq, pause)

        def ahead(waiting: Sequence) -> bool:  # paused, admitted before it, and (by priority) of its priority
            if self.by_priority and waiting.priority != seq.priority:
                return waiting.priority < seq.priority
            return waiting.paused is not None and waiting.admitted < seq.admitted

        self.waiting.insert(_behind(self.waiting, ahead), seq)

    # A lost group, and a shutdown.

    def pause(self, lost: Pause, blamed: Collection[Sequence], tries: int) -> BatchPaused:
        """The group was lost under the batch: every admitted sequence goes back to the front of the queue, in
        order, to be fed again once the ranks are back: its prompt and the tokens it has produced (its stream
        goes on where it stopped); the ranks' caches are gone, the prefix cache with them. Those ``blamed``
        count one more loss; one blamed more than ``tries`` times is not resumed. Cancelled ones just leave."""
        paused, given_up, cancelled = [], [], []
        for seq in self.batch:
            if seq.cancelled_at is not None and not seq.finished:
                seq.status = Status.FINISHED_ABORTED
                cancelled.append((seq, self.steps - seq.cancelled_at))
            if seq.finished or seq.cancelled_at is not None:
                continue
            if seq in blamed:
                seq.losses += 1
            if seq.losses > tries:
                seq.status = Status.FINISHED_ERROR
                given_up.append(seq)
                continue
            _replay_later(seq, lost)
            paused.append(seq)
        self._empty_batch()
        self.waiting.extendleft(reversed(paused))
        if self.prefix is not None:
            self.prefix.unpin()
            self.prefix.clear()
        return BatchPaused(paused, given_up, cancelled)

    def clear(self) -> list[Sequence]:
        """Forget every request, queued or admitted (the ranks' caches are cleared); returns those unfinished,
        each marked as cancelled now."""
        queued = [member for seq in self.waiting for member in (seq, *seq.copies, *seq.group)]
        unfinished = [seq for seq in (*queued, *self.batch) if not seq.finished]
        for seq in unfinished:
            seq.cancelled_at = self.steps
            seq.status = Status.FINISHED_ABORTED
        self.waiting.clear()
        self._empty_batch()
        if self.prefix is not None:
            self.prefix.unpin()
        return unfinished

    def _empty_batch(self) -> None:
        for place in (self.filling, self.running, self.leaving, self.stopping, self.keeping):
            place.clear()


def _behind(waiting: deque[Sequence], ahead: Callable[[Sequence], bool]) -> int:
    """Where a sequence joins the queue: after the run of those at its front that go ``ahead`` of it."""
    at = 0
    while at < len(waiting) and ahead(waiting[at]):
        at += 1
    return at


def _replay_later(seq: Sequence, pause: Pause) -> None:
    """``seq`` is paused (a lost group, a preemption): it waits to be fed its prompt and its output so far again, on
    its own, its stream open. Paused again before it resumed, the first pause is what it waits on."""
    seq.paused = seq.paused or pause
    seq.replay = [*seq.prompt, *seq.output] if seq.output else None
    seq.alone = True
    seq.fed = seq.held = seq.drop = seq.micro_batch = 0
    seq.status = Status.WAITING
