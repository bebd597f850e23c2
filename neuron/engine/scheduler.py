"""The scheduler: who waits, whose prompt is fed, who decodes; each step's plan, and what a step's outcome changes.

It only decides. No I/O, no MLX, no event loop: the engine hands it requests
(``add``, ``cancel``, and ``finish`` when a stop string ends one), asks it
what runs next (``schedule``: the step's plan, and who was admitted, dropped
or released), runs the plan on the pool, and hands the step's result back
(``update``: who got which token, and who ended). A sequence ends here on
token ids and lengths only; stop strings are found where the text is
(``engine.output``). So every decision here can be tested in milliseconds,
without a process.

Continuous batching: up to ``max_batch`` sequences share each step. A waiting
request is admitted when a place frees; its prompt is fed in chunks, at most
``prefill_chunk`` tokens per step across all prompts being fed, and while
others decode only as many as keep the step within ``itl_target_ms``
(``prefill_budget``), so a long prompt never stalls the running sequences for
long; once fed, it decodes one token per step with the others. A sequence
that ends or is cancelled leaves at the next step boundary: the next plan
tells every rank to drop it.

Prefix cache: when a prompt is first fed, the scheduler asks the prefix index
for its longest cached beginning, and the plan restores it instead of feeding
it; when a prompt's last chunk is fed, the plan saves the whole prompt as an
entry (evicting others to stay within budget), so the next request that starts
the same way, a chat's next turn among them, skips that part.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from neuron.config.settings import (  # its fields are settings of ``serve``, declared there once
    MIN_PREFILL_CHUNK,
    Scheduling,
)
from neuron.engine import fairness, memory
from neuron.engine.admission import Admission
from neuron.engine.drafts import StepCost, attended
from neuron.engine.memory import Budget
from neuron.engine.planner import plan_step
from neuron.engine.prefix import PrefixIndex
from neuron.engine.queues import Queues
from neuron.engine.sequence import Pause, Sequence, Status
from neuron.step import DraftRow, Sampled, Step


@dataclass(frozen=True, slots=True)
class Turn:
    """What the engine does this turn, in order: tell the readers of ``cancelled``
    that their sequences left, start the ``admitted`` ones, then run ``step`` on every rank; with no step,
    ``clear`` says one clear of every rank's caches is owed (it frees the sequences that left at once)."""

    step: Step | None  # None when nothing is admitted
    admitted: list[Sequence] = field(default_factory=list)  # taken into the batch this turn, in order
    cancelled: list[tuple[Sequence, int]] = field(default_factory=list)  # each with the steps it ran after its cancel
    clear: bool = False
    # Paused for memory, their streams open: back at the front of the queue, to resume as the batch gives room.
    preempted: list[Sequence] = field(default_factory=list)
    # Alone, and still more than the memory budget holds now (it shrank): they end with an error.
    unfit: list[Sequence] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Delivery:
    """What one step gave ``seq``: a token, whether it is part of the output, and how the sequence ends, if it does.

    ``kept`` is False when the token is not part of the output: an end-of-sequence
    token, a constraint's dead end, a prompt scored with ``max_tokens`` 0.
    ``finish`` is ``"stop"`` (an end-of-sequence or stop token), ``"length"``, or
    ``"error"`` (``sampled.error``: the output constraint failed); None while it
    goes on. A stop string is not the scheduler's to see: the output path finds it
    in the text and calls ``Scheduler.finish``. ``produced`` is how many tokens the
    sequence has produced with this one. ``first`` marks the token sampled from the
    end of the prompt.
    """

    seq: Sequence
    sampled: Sampled
    finish: str | None
    first: bool
    kept: bool = True
    produced: int = 0


def prefill_budget(limits: Scheduling, cost: StepCost, decoding: int, depth: int = 0, beside: int | None = None) -> int:
    """The prompt tokens the next step feeds, across all prompts being fed, beside ``decoding`` running sequences,
    the prompts fed from ``depth`` on (the deepest). ``beside``: where several prompts are being fed, the tokens
    all but the longest have left (None: one prompt, or none).

    With none decoding and one prompt there is no one's latency to protect: ``prefill_chunk``. Otherwise as many as
    the step's time after its decode rows leaves room for under ``itl_target_ms``, priced by what the last steps'
    prompt tokens cost (``StepCost.observe_prompt``), within ``MIN_PREFILL_CHUNK`` and ``prefill_chunk``: the
    floor keeps a prompt moving where the decode rows alone fill the target. A chunk at most doubles the largest
    one priced, since a price fitted on small chunks says little of one many times their size. Until a prompt
    token is priced (a cold start), the floor: a chunk too small costs the prompt a few steps, one too large
    would stall every stream for as long as it takes.

    With none decoding, the prompts fed beside the longest (fed first: ``planner``) are fed whole, and the longest
    as far as the target leaves room past them: the step that gives a short request, sent while a long prompt is
    fed, its first token never takes seconds. Until a prompt token is priced, where none decodes, the cap: prompts
    that arrive together as the server starts are fed together.
    """
    cap = limits.prefill_chunk
    if (not decoding and (beside is None or cost.token_ms is None)) or not limits.itl_target_ms:
        return cap
    if cost.token_ms is None:
        sized = MIN_PREFILL_CHUNK
    else:
        fits = cost.prompt_fits(limits.itl_target_ms - cost.ms(decoding), depth)
        sized = max(MIN_PREFILL_CHUNK, min(2 * cost.largest_chunk, math.floor(min(fits, cap))))
    if not decoding and beside is not None:
        sized += beside
    return min(cap, sized)


# A decode step measured at most this long is mostly host time. On MLX's CPU backend a rank alone then runs the
# next step ahead (``--run-ahead auto``: ``engine.ahead_for``), as the thread hops that running ahead hides outweigh
# the forward it wastes where a plan changes, and the event loop keeps off rank 0's core; above it, measured on SmolLM2
# and the tiny model's wider batches, neither paid (BENCHMARKS.md, issue 49), and rank 0's threads spread over its
# cores (``Pool.place_rank0``).
SHORT_STEP_MS = 3.0


def ahead_for(backend: str, world_size: int, micro_batches: int) -> str:
    """What ``--run-ahead auto`` means here: ``on`` where MLX evaluates asynchronously (a GPU hides the host's part
    of a step behind the device's); on MLX's CPU backend, which evaluates in the caller, ``auto`` (the scheduler
    runs ahead only steps its measured cost says are short: ``scheduler.runs_ahead``) for one rank and one
    micro-batch, ``off`` for a group of ranks, where running ahead lost in every run (BENCHMARKS.md, issue 49)."""
    if backend != "cpu":
        return "on"
    return "auto" if world_size == 1 and micro_batches == 1 else "off"


def short(cost: StepCost, decoding: int) -> bool:
    """Whether the engine has timed steps of ``decoding`` rows and their median is within ``SHORT_STEP_MS``."""
    measured = cost.measured.get(decoding)
    return measured is not None and measured <= SHORT_STEP_MS


def runs_ahead(setting: str, cost: StepCost, decoding: int) -> bool:
    """Whether a steady step of ``decoding`` rows may run the next one ahead (``plan_step`` says whether it is
    steady): ``on`` always, ``off`` never, ``auto`` (one CPU rank) where its steps are ``short``."""
    if setting != "auto":
        return setting == "on"
    return short(cost, decoding)


def outcome(seq: Sequence, sampled: Sampled, eos_token_ids: frozenset[int], *, first: bool) -> Delivery:
    """Every way a sampled token can end its sequence by its id or the sequence's length, decided here and nowhere
    else (a stop string is the output path's: ``Scheduler.finish``); a token that goes on is added to its output."""
    if sampled.error is not None:
        return Delivery(seq, sampled, "error", first, kept=False, produced=seq.completion_tokens)
    if seq.max_tokens == 0:  # the prompt, scored, was all it asked for: the token is not used
        return Delivery(seq, sampled, "length", first, kept=False)
    params = seq.params
    if sampled.token in params.stop_token_ids or (sampled.token in eos_token_ids and not params.ignore_eos):
        return Delivery(seq, sampled, "stop", first, kept=False, produced=seq.completion_tokens)
    seq.completion_tokens += 1
    seq.next_token = sampled.token
    seq.output.append(sampled.token)
    ends = "length" if seq.completion_tokens >= seq.max_tokens else None
    return Delivery(seq, sampled, ends, first, produced=seq.completion_tokens)


_ENDS = {"stop": Status.FINISHED_STOPPED, "length": Status.FINISHED_LENGTH, "error": Status.FINISHED_ERROR}


class Scheduler:
    def __init__(
        self,
        limits: Scheduling,
        eos_token_ids: set[int] | frozenset[int],
        prefix: PrefixIndex | None = None,
        budget: Budget | None = None,
    ) -> None:
        self.limits = limits
        self.prefix = prefix  # None: no prefix cache
        # The memory budget (``engine.memory``): admission, preemption and the prefix cache's share follow it; None:
        # places alone decide (the scheduler's own tests).
        self.budget = budget
        self.scored_chunk: int | None = None  # the most prompt tokens a step scores (``Budget.scored_chunk``)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.queues = queues = Queues(limits, prefix)  # where every sequence is
        self.waiting, self.filling, self.running = queues.waiting, queues.filling, queues.running
        self.cost = StepCost()  # what a decode step costs, for the drafts' width, refined from the steps applied
        self.admission = Admission(limits, budget, queues.waiting, queues.filling, queues.running)

    @property
    def batch(self) -> tuple[Sequence, ...]:
        """Every admitted sequence: prompts being fed, then the decoding ones (``Queues.batch``, read here from the
        queues' own lists)."""
        return (*self.filling, *self.running)

    @property
    def steps_short(self) -> bool | None:
        """Whether the batch's decode steps, as timed, are ``short``: mostly host time; None until timed."""
        if self.cost.measured.get(len(self.running)) is None:
            return None
        return short(self.cost, len(self.running))

    # The turn: what runs next, and what it did.

    def to_draft(self) -> list[DraftRow]:
        """The rows the draft model (``--draft-model``) proposes for before the next plan is made: each running
        sequence that drafts with it, its context (its prompt and output, the token it is about to be fed last) and
        how many tokens it wants (``Proposer.wanted``). Their proposals go to ``schedule``."""
        rows = []
        for seq in self.running:
            proposer = seq.proposer
            if proposer is None or not proposer.model or seq.next_token is None or seq.cancelled_at is not None:
                continue
            if k := proposer.wanted(seq.max_tokens - seq.completion_tokens - 1):
                rows.append(DraftRow(seq.no, [*seq.prompt, *seq.output], k, seq.params))
        return rows

    def schedule(self, proposed: Mapping[int, list[int]] | None = None) -> Turn:
        """Drop the cancelled and stopped sequences (they leave in this plan), admit waiting requests while the
        batch has places and memory, and plan the step, with the draft model's ``proposed`` tokens (``to_draft``);
        with nothing to run, release who leaves (a clear is owed)."""
        cancelled = [seq for seq in self.batch if seq.cancelled_at is not None]
        for seq in cancelled:
            self.queues.remove(seq, Status.FINISHED_ABORTED)
        for seq in self.queues.stopping:
            self.queues.remove(seq, Status.FINISHED_STOPPED)
        self.queues.stopping.clear()
        preempted, unfit = self._fit()
        admitted: list[Sequence] = []
        if self.waiting:  # a steady decode step has no one to make room for, admit or drop
            preempted += self._make_room()
            admitted = self.admission.admit()
            unfit += self.admission.drop_stuck()
        limits = self.limits
        # The deepest position a prompt is fed from. One not yet started may restore a cached beginning of any
        # length (the plan looks it up): priced as fed from its end, its first chunk errs small.
        depth = max((seq.fed or len(seq.tokens) for seq in self.filling), default=0)
        left = sorted(len(seq.tokens) - seq.fed for seq in self.filling)
        beside = sum(left[:-1]) if len(left) > 1 else None
        step = plan_step(
            self.filling,
            self.running,
            self.waiting,
            self.queues.leaving,
            budget=prefill_budget(limits, self.cost, len(self.running), depth, beside),
            max_batch=limits.max_batch,
            micro_batches=limits.micro_batches,
            run_ahead=runs_ahead(limits.run_ahead, self.cost, len(self.running)),
            prefix=self.prefix,
            cost=self.cost,
            keeping=self.queues.keeping,
            spill=self.queues.spill,
            parking=self.queues.parking,
            scored_chunk=self.scored_chunk,
            proposed=proposed,
        )
        self.queues.keeping.clear()
        self.queues.parking.clear()
        self.size_prefix_cache()  # after the plan's lookups: an entry it restores is pinned, and stays
        clear = step is None and bool(self.queues.leaving)
        if clear:  # nothing left to run: clearing every rank's sequences at once drops them all
            self.queues.leaving.clear()
        cancels = [(seq, self.queues.steps - (seq.cancelled_at or 0)) for seq in cancelled]
        return Turn(step, admitted, cancels, clear, preempted, unfit)

    def update(self, step: Step, sampled: dict[int, Sampled], ms: float) -> list[Delivery]:
        """What ``step`` did, now that every rank ran it in ``ms``: prompts fed, tokens sampled, in plan order, and
        every sequence that ended on a token id or its length (it has left the batch: the next plan drops it on
        every rank).

        A sequence missing from the batch was taken out while the step ran
        (cancelled, or failed by a shutdown): its token is not delivered.
        """
        plan = step.plan
        self.queues.steps += 1
        self.queues.leaving.clear()
        if self.prefix is not None and self.prefix.pinned:
            self.prefix.unpin()
        if plan.decode and not plan.prefill and not plan.restore:  # a prompt's tokens would blur the decode cost
            self.cost.observe(plan.rows_fed, ms)
        elif plan.prefill and not plan.restore and not any(chunk.images for chunk in plan.prefill):
            pairs = sum(attended(chunk.position, len(chunk.tokens)) for chunk in plan.prefill)
            self.cost.observe_prompt(plan.prefill_tokens, pairs, plan.rows_fed, ms)  # an image's encoder would blur it
        by_no = {seq.no: seq for seq in self.batch}
        for restore in plan.restore:
            if (seq := by_no.get(restore.seq)) is not None:
                seq.fed = restore.tokens
                if seq.replay is None:  # a resumed sequence's usage keeps what its first prefill reused
                    seq.cached = restore.tokens
        out = []
        for chunk in plan.prefill:
            if (seq := by_no.get(chunk.seq)) is None:
                continue
            seq.fed += len(chunk.tokens)
            if chunk.last and seq.pooling is not None:  # every rank has dropped it already: it leaves no plan
                self.filling.remove(seq)
                out.append(Delivery(seq, sampled[seq.no], "stop", first=True, kept=False))
            elif chunk.last:
                for copy in [seq, *(by_no[no] for no in chunk.copies if no in by_no)]:
                    copy.fed = copy.held = len(copy.tokens)
                    self.filling.remove(copy)
                    copy.micro_batch = _emptiest(self.running, self.limits.micro_batches)
                    copy.status = Status.RUNNING
                    self.running.append(copy)
                    if copy.replay is None:
                        copy.prompt_logprobs = sampled[copy.no].prompt
                    out.append(outcome(copy, sampled[copy.no], self.eos_token_ids, first=copy.replay is None))
        widths = plan.widths()
        for row in plan.decode:
            if (seq := by_no.get(row.seq)) is None:
                continue
            run = [sampled[row.seq], *sampled[row.seq].more]  # the token, then those a kept draft adds
            seq.held += len(run)  # the token fed, and each draft token the sampler agreed with
            for one in run:
                out.append(outcome(seq, one, self.eos_token_ids, first=False))
                if out[-1].finish is not None:
                    break
            seq.drop = widths[row.micro_batch] - len(run)  # fed but not kept: the draft's rejected tail, the padding
            if seq.proposer is not None:  # what was verified: a draft the width cut is not a miss
                seq.proposer.update(len(row.draft), len(run) - 1)
        for delivery in out:
            if delivery.finish is not None:
                self.queues.remove(delivery.seq, _ENDS[delivery.finish])
        return out

    def admissible(self) -> list[Sequence]:
        """The waiting requests the next ``schedule`` admits (``Admission``)."""
        return self.admission.admissible()

    def usage(self) -> int:
        """The bytes (the reference share's: ``engine.memory``) the batch's caches may hold by the end of the next
        step."""
        if self.budget is None:
            return 0
        queues = self.queues
        return self.budget.usage(memory.rows_by_micro_batch(queues.filling, queues.running, self.limits.micro_batches))

    # Memory.

    def _fit(self) -> tuple[list[Sequence], list[Sequence]]:
        """Preempt the newest generating sequences while the batch's caches would pass the memory budget by the end
        of the next step (``memory.overflow``; the prefix cache gives way first: it holds only what the batch
        leaves). One alone that would still pass it ends: it is returned second."""
        if self.budget is None:  # places alone decide (the scheduler's own tests)
            return [], []
        queues = self.queues
        preempted, unfit = memory.overflow(self.budget, queues.filling, queues.running, self.limits.micro_batches)
        for seq in preempted:
            rank, host = self.budget.where()
            cause = f"the batch's caches would pass the memory budget ({self.budget.bytes} bytes on rank {rank})"
            self.queues.preempt(seq, Pause("memory", rank, host, cause, time.perf_counter()))
        if unfit is None:
            return preempted, []
        self.queues.remove(unfit, Status.FINISHED_ERROR)
        return preempted, [unfit]

    def _make_room(self) -> list[Sequence]:
        """While the next request admission takes (``Admission.order``: the first generating one) cannot join,
        preempt a sequence of the batch for it: under the priority policy the lowest-priority one of a lower
        priority than its own, the newest admitted of those (none of the same priority or better is ever preempted
        for it); else, with requests of several API keys in flight, the newest of the key holding more than its
        share of the batch (``fairness.victim``)."""
        by_priority = self.limits.scheduling_policy == "priority"
        if not by_priority and len(fairness.keyed((*self.waiting, *self.batch))) < 2:
            return []  # first come, first served: nothing to preempt for
        preempted: list[Sequence] = []
        while (head := next((seq for seq in self.admission.order() if seq.pooling is None), None)) is not None:
            if head in self.admission.admissible():
                break
            lower = [seq for seq in self.batch if seq.pooling is None and seq.priority > head.priority]
            if by_priority and lower:
                seq = max(lower, key=lambda seq: (seq.priority, seq.admitted))
                reason = "priority"
                cause = (
                    f"request {head.request_id} of priority {head.priority} took its place "
                    f"(its priority {seq.priority})"
                )
            elif (unfair := fairness.victim(head, self.batch, by_priority)) is not None:
                seq, reason = unfair, "fair_share"
                cause = f"request {head.request_id} of API key {head.key!r} took its place, over its key's share"
            else:
                break
            self.queues.preempt(seq, Pause(reason, 0, "", cause, time.perf_counter()))
            preempted.append(seq)
        return preempted

    def size_prefix_cache(self) -> None:
        """The prefix cache holds what the batch leaves of the memory budget, at most ``--prefix-cache-bytes``."""
        if self.prefix is None or self.budget is None:
            return
        left = max(0, self.budget.bytes - self.usage())
        cap = self.limits.prefix_cache_bytes
        bound = left if cap is None else min(cap, left)
        if self.prefix.bytes > bound:
            self.prefix.shrink(bound)
        else:  # what it holds fits: only the bound moves, for the entries to come
            self.prefix.budget = bound


def _emptiest(running: list[Sequence], micro_batches: int) -> int:
    """The micro-batch a sequence joins: the one with the fewest rows (the first of those), so passes stay even."""
    sizes = [0] * micro_batches
    for seq in running:
        sizes[seq.micro_batch] += 1
    return sizes.index(min(sizes))
