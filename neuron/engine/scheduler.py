"""The scheduler: who waits, whose prompt is fed, who decodes; each step's plan, and what a step's outcome changes.

It only decides. No I/O, no MLX, no event loop: the engine hands it requests,
asks it for a plan, runs the plan on the pool, and hands the sampled tokens
back. So every decision here can be tested in milliseconds, without a process.

Continuous batching: up to ``max_batch`` sequences share each step. A waiting
request is admitted when a place frees; its prompt is fed in chunks, at most
``prefill_chunk`` tokens per step across all prompts being fed, so a long
prompt never stalls the running sequences for long; once fed, it decodes one
token per step with the others. A sequence that ends or is cancelled leaves
at the next step boundary: the next plan tells every rank to drop it.

Prefix cache: when a prompt is first fed, the scheduler asks the prefix index
for its longest cached beginning, and the plan restores it instead of feeding
it; when a prompt's last chunk is fed, the plan saves the whole prompt as an
entry (evicting others to stay within budget), so the next request that starts
the same way, a chat's next turn among them, skips that part.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from neuron.engine.drafts import StepCost, width
from neuron.engine.prefix import PrefixIndex
from neuron.engine.sequence import Lost, Overloaded, Sequence
from neuron.rpc import Decode, Evict, Prefill, Restore, Save, StepPlan
from neuron.sampling_params import PENALTY_WINDOW, Sampled
from neuron.step import Start, Step


@dataclass(frozen=True, slots=True)
class Scheduling:
    """How the scheduler runs the batch: its limits, speculation and running ahead; these defaults are ``neuron
    serve``'s (config.py reads them from here)."""

    max_batch: int = 8  # sequences decoding together; more wait in the queue
    max_waiting: int = 64  # requests queued beyond the batch; more get 429
    prefill_chunk: int = 512  # prompt tokens fed per step, across all prompts being fed
    max_context: int | None = None  # tokens per request (prompt + completion); None: the model's own
    micro_batches: int = 1  # decode passes per step: a pipeline's stages then work at once
    prefix_cache_bytes: int = 1 << 30  # the prefix cache's budget on the rank holding the largest share; 0: off
    max_n: int = 8  # choices per request (n), each a sequence of the batch: at most max_batch
    speculate: str = "ngram"  # draft tokens from prompt lookup and ``prediction`` (engine.drafts); "off": none
    # Steady decode steps queued before the last one's tokens are read (tp.ahead): "on", "off", or "auto": on where
    # MLX evaluates asynchronously (GPUs); its CPU backend evaluates in the caller, so there it would only waste a
    # forward where a plan changes (BENCHMARKS.md, "Running ahead").
    run_ahead: str = "auto"
    # A lost group (engine.resume): seconds the paused requests wait for the pool to be back (0: they fail at once,
    # and the leader restarts its process), and the losses a request may be blamed for and still resume.
    resume_timeout: float = 60.0
    resume_tries: int = 2
    # How embedding inputs pool the final hidden states (models.POOLING_TYPES); None: as the model's card says,
    # else MEAN. Not the scheduler's to read: it plans what each input's sequence says.
    pooling_type: str | None = None
    constrained_reasoning_tokens: int = 1024  # a constrained gpt-oss reply's analysis before its constrained message


class Detokenizer(Protocol):
    """Turns a sequence's tokens into text (``engine.text.Text``): what each releases, and whether a stop string
    ended it. The scheduler asks it, token by token, because whether a token ends the sequence decides whether the
    next one is text at all."""

    def push(self, seq: Sequence, token: int) -> tuple[str, bool]: ...

    def finish(self, seq: Sequence) -> tuple[str, bool]: ...


@dataclass(frozen=True, slots=True)
class Delivery:
    """What one step gave ``seq``: a token and the text it released, and how the sequence ends, if it does.

    ``text`` is None when the token is not part of the output: an end-of-sequence
    token, a constraint's dead end, a prompt scored with ``max_tokens`` 0.
    ``finish`` is ``"stop"`` (an end-of-sequence token or a stop string),
    ``"length"``, or ``"error"`` (``sampled.error``: the output constraint
    failed); None while it goes on. ``tail`` is the text held back until the
    end (a partial character, a stop string's possible start), released with
    the finish. ``first`` marks the token sampled from the end of the prompt.
    """

    seq: Sequence
    sampled: Sampled
    text: str | None
    finish: str | None
    first: bool
    tail: str = ""


class Scheduler:
    def __init__(
        self, limits: Scheduling, eos_token_ids: set[int] | frozenset[int], prefix: PrefixIndex | None = None
    ) -> None:
        self.limits = limits
        self.prefix = prefix  # None: no prefix cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.steps = 0  # steps applied; cancellations are measured against it
        self.waiting: deque[Sequence] = deque()
        self.filling: list[Sequence] = []  # admitted, prompt being fed
        self.running: list[Sequence] = []  # decoding, in batch order
        self.leaving: list[int] = []  # sequences every rank drops in the next plan
        self.cost = StepCost()  # what a decode step costs, for the drafts' width, refined from the steps applied

    @property
    def batch(self) -> tuple[Sequence, ...]:
        """Every admitted sequence: prompts being fed, then the decoding ones."""
        return (*self.filling, *self.running)

    @property
    def pending(self) -> int:
        return len(self.waiting) + len(self.filling) + len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` behind the others, or refuse it when the queue is full."""
        if len(self.waiting) >= self.limits.max_waiting:
            raise Overloaded(f"{len(self.waiting)} requests are already waiting (the limit); retry shortly")
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> bool:
        """Mark ``seq`` as abandoned by its caller; True when it was still queued and has left at once."""
        if seq.finished or seq.cancelled_at is not None:
            return False
        seq.cancelled_at = self.steps
        if seq in self.waiting:
            self.waiting.remove(seq)
            return True
        return False

    def drop_cancelled(self) -> list[tuple[Sequence, int]]:
        """Take the cancelled sequences out of the batch (they leave in the next plan); returns each with the steps
        it ran after its caller went away."""
        dropped = [seq for seq in self.batch if seq.cancelled_at is not None]
        for seq in dropped:
            self._remove(seq)
        return [(seq, self.steps - (seq.cancelled_at or 0)) for seq in dropped]

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the batch, in arrival order, while it has places; returns them.

        An embedding request holds no place (its inputs are fed and leave, and no decode row is theirs), so it
        is admitted at once, past a generation that waits for a place: that one gets the next place all the same.
        """
        admitted: list[Sequence] = []
        places = len(self.running) + sum(seq.pooling is None for seq in self.filling)
        blocked = False
        for seq in list(self.waiting):
            if seq.pooling is None:
                blocked = blocked or places + seq.n > self.limits.max_batch
                if blocked:
                    continue
                places += seq.n
            self.waiting.remove(seq)
            members = [seq] if seq.alone else [seq, *seq.copies, *seq.group]
            self.filling += members
            admitted += members
        return admitted

    def release_leaving(self) -> bool:
        """With nothing to run: forget who leaves, since clearing every rank's sequences at once drops them all;
        True when there was someone, and so a clear is owed."""
        owed = bool(self.leaving)
        self.leaving.clear()
        return owed

    def plan(self) -> Step | None:
        """The next step: who leaves, which prompt chunks are fed, every running sequence's next input, and how
        each sequence it starts is sampled.

        None when nothing is admitted (``leaving`` may still name sequences to drop).
        """
        if not self.filling and not self.running:
            return None
        budget = self.limits.prefill_chunk
        prefill: list[Prefill] = []
        restore: list[Restore] = []
        starts: dict[int, Start] = {}
        suspect = False  # whether the step feeds a sequence blamed for a lost group
        for seq in self.filling:
            if budget <= 0:
                break
            if seq.copy_of is not None and not seq.alone:
                continue  # fed when its original's prompt ends
            if prefill and (seq.losses or suspect):
                break  # a sequence blamed for a lost group is fed alone, so that a second loss blames it alone
            suspect = bool(seq.losses)
            tokens = seq.tokens
            start = seq.fed
            if seq.pooling is not None:  # an embedding input: no prefix cache (hidden states are not kept), no sampler
                end = min(len(seq.prompt), start + budget)
                prefill.append(Prefill(seq.no, start, seq.prompt[start:end], end == len(seq.prompt), pool=seq.pooling))
                budget -= end - start
                continue
            # A restored prefix would leave its tokens unscored; a resumed sequence's prompt was scored already.
            scores = seq.params.prompt_logprobs is not None and seq.replay is None
            prefix = self.prefix if seq.params.prompt_logprobs is None else None
            if start == 0:
                produced = None if seq.lost is None else tuple(seq.output)
                recent: tuple[int, ...] = ()
                if prefix is not None and (hit := prefix.lookup(tokens)) is not None:
                    restore.append(Restore(seq.no, hit.entry, hit.tokens))
                    start = hit.tokens  # restored, not computed: outside the budget
                    recent = tuple(tokens[max(0, start - PENALTY_WINDOW) : start])
                starts[seq.no] = Start(seq.params, recent, produced)
            take = min(budget, len(tokens) - start)
            end = start + take
            last = end == len(tokens)
            copies = [c for c in seq.fed_with if c in self.filling] if last else []
            for copy in copies:
                starts[copy.no] = Start(copy.params, tuple(copy.prompt[-PENALTY_WINDOW:]))
            prefill.append(Prefill(seq.no, start, tokens[start:end], last, [c.no for c in copies], scores))
            budget -= take
        decode = self._decode()
        ahead = self._steady(prefill, decode)
        plan = StepPlan(leave=list(self.leaving), prefill=prefill, decode=decode, restore=restore, ahead=ahead)
        # Saved only after every lookup: a rank restores before it saves, so no plan may restore what it saves.
        by_no = {seq.no: seq for seq in self.filling}
        for chunk in prefill:
            if chunk.pool or not chunk.last or self.prefix is None:
                continue
            if stored := self.prefix.store(by_no[chunk.seq].tokens):
                plan.save.append(Save(chunk.seq, stored.entry))
                plan.evict.extend(Evict(entry) for entry in stored.evicted)
        return Step(plan, starts)

    def apply(self, step: Step, sampled: dict[int, Sampled], text: Detokenizer, ms: float) -> list[Delivery]:
        """What ``step`` did, now that every rank ran it in ``ms``: prompts fed, tokens sampled, in plan order, and
        every sequence that ended (it has left the batch: the next plan drops it on every rank).

        A sequence missing from the batch was taken out while the step ran
        (cancelled, or failed by a shutdown): its token is not delivered.
        """
        plan = step.plan
        self.steps += 1
        self.leaving.clear()
        if self.prefix is not None:
            self.prefix.unpin()
        if plan.decode and not plan.prefill and not plan.restore:  # a prompt's tokens would blur the decode cost
            self.cost.observe(plan.rows_fed, ms)
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
                out.append(Delivery(seq, sampled[seq.no], None, "stop", first=True))
            elif chunk.last:
                for copy in [seq, *(by_no[no] for no in chunk.copies if no in by_no)]:
                    copy.fed = len(copy.tokens)
                    self.filling.remove(copy)
                    copy.micro_batch = self._emptiest_micro_batch()
                    self.running.append(copy)
                    if copy.replay is None:
                        copy.prompt_logprobs = sampled[copy.no].prompt
                    out.append(self._outcome(copy, sampled[copy.no], text, first=copy.replay is None))
        widths = plan.widths()
        for row in plan.decode:
            if (seq := by_no.get(row.seq)) is None:
                continue
            run = [sampled[row.seq], *sampled[row.seq].more]  # the token, then those a kept draft adds
            for one in run:
                out.append(self._outcome(seq, one, text, first=False))
                if out[-1].finish is not None:
                    break
            seq.drop = widths[row.micro_batch] - len(run)  # fed but not kept: the draft's rejected tail, the padding
            if seq.proposer is not None:  # what was verified: a draft the width cut is not a miss
                seq.proposer.update(len(row.draft), len(run) - 1)
        for delivery in out:
            if delivery.finish is not None:
                self._remove(delivery.seq)
        return out

    def _steady(self, prefill: list[Prefill], decode: list[Decode]) -> bool:
        """Whether the next step will most likely decode the same rows, one token each (the ranks may run it
        ahead): no prompt fed now or soon, no draft now (a row that drafts now drafts next too, most likely), one
        micro-batch. A sequence that ends meanwhile just leaves."""
        if self.limits.run_ahead != "on" or prefill or self.filling or not decode or self.limits.micro_batches != 1:
            return False
        if self.waiting and len(self.running) + self.waiting[0].n <= self.limits.max_batch:
            return False
        if all(seq.completion_tokens + 1 >= seq.max_tokens for seq in self.running):
            return False  # every row ends with this step's token: a step ahead would be thrown away
        return not any(row.draft for row in decode)

    def _decode(self) -> list[Decode]:
        """Every running sequence's row: its token, and its draft cut to the width its micro-batch pays for."""
        drafts = {seq.no: self._draft(seq) for seq in self.running}
        share = 1 / self.limits.micro_batches  # each micro-batch's part of the step's fixed time
        for micro_batch in range(self.limits.micro_batches):
            rows = [seq for seq in self.running if seq.micro_batch == micro_batch]
            estimates = [(len(drafts[seq.no]), seq.proposer.acceptance if seq.proposer else 0.0) for seq in rows]
            cut = width(estimates, self.cost, share) - 1
            for seq in rows:
                drafts[seq.no] = drafts[seq.no][:cut]
        return [
            Decode(seq.no, seq.next_token, seq.micro_batch, drafts[seq.no], seq.drop)  # type: ignore[arg-type]
            for seq in self.running
        ]

    def _draft(self, seq: Sequence) -> list[int]:
        """The tokens ``seq`` proposes after its next one: never more than ``max_tokens`` leaves room for."""
        if seq.proposer is None or seq.next_token is None:
            return []
        room = seq.max_tokens - seq.completion_tokens - 1
        return seq.proposer.propose(seq.prompt, seq.output, room)

    def _emptiest_micro_batch(self) -> int:
        """The micro-batch a sequence joins: the one with the fewest rows (the first of those), so passes stay even."""
        sizes = [0] * self.limits.micro_batches
        for seq in self.running:
            sizes[seq.micro_batch] += 1
        return sizes.index(min(sizes))

    def _outcome(self, seq: Sequence, sampled: Sampled, text: Detokenizer, *, first: bool) -> Delivery:
        """Every way a sampled token can end its sequence, decided here and nowhere else."""
        if sampled.error is not None:
            return Delivery(seq, sampled, None, "error", first)
        if seq.max_tokens == 0:  # the prompt, scored, was all it asked for: the token is not used
            return Delivery(seq, sampled, None, "length", first)
        params = seq.params
        if sampled.token in params.stop_token_ids or (sampled.token in self.eos_token_ids and not params.ignore_eos):
            tail, _ = text.finish(seq)  # the end-of-sequence token is not part of the text
            return Delivery(seq, sampled, None, "stop", first, tail)
        seq.completion_tokens += 1
        seq.next_token = sampled.token
        seq.output.append(sampled.token)
        released, stopped = text.push(seq, sampled.token)
        if stopped:
            return Delivery(seq, sampled, released, "stop", first)
        if seq.completion_tokens >= seq.max_tokens:
            tail, stopped = text.finish(seq)  # a stop string may still close in the text held back
            return Delivery(seq, sampled, released, "stop" if stopped else "length", first, tail)
        return Delivery(seq, sampled, released, None, first)

    def _remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the batch; the ranks drop it in the next plan, if any of its prompt reached them."""
        for place in (self.filling, self.running):
            if seq in place:
                place.remove(seq)
                if seq.fed:
                    self.leaving.append(seq.no)

    def pause(self, lost: Lost, blamed: Collection[Sequence], tries: int) -> tuple[list[Sequence], list[Sequence]]:
        """The group was lost under the batch: every admitted sequence goes back to the front of the queue, in
        order, to be fed again once the ranks are back: its prompt and the tokens it has produced (its stream
        goes on where it stopped); the ranks' caches are gone, the prefix cache with them. Those ``blamed``
        count one more loss; one blamed more than ``tries`` times is not resumed. Returns (paused, given up)."""
        paused, given_up = [], []
        for seq in self.batch:
            if seq.finished or seq.cancelled_at is not None:
                continue
            if seq in blamed:
                seq.losses += 1
            if seq.losses > tries:
                given_up.append(seq)
                continue
            seq.lost = seq.lost or lost  # lost again before it resumed: the first loss is what it waits on
            seq.replay = [*seq.prompt, *seq.output] if seq.output else None
            seq.alone = True
            seq.fed = seq.drop = seq.micro_batch = 0
            paused.append(seq)
        self.filling.clear()
        self.running.clear()
        self.leaving.clear()
        self.waiting.extendleft(reversed(paused))
        if self.prefix is not None:
            self.prefix.unpin()
            self.prefix.clear()
        return paused, given_up

    def clear(self) -> list[Sequence]:
        """Forget every request, queued or admitted (the ranks' caches are cleared); returns those unfinished,
        each marked as cancelled now."""
        queued = [member for seq in self.waiting for member in (seq, *seq.copies, *seq.group)]
        unfinished = [seq for seq in (*queued, *self.batch) if not seq.finished]
        for seq in unfinished:
            seq.cancelled_at = self.steps
        self.waiting.clear()
        self.filling.clear()
        self.running.clear()
        self.leaving.clear()
        if self.prefix is not None:
            self.prefix.unpin()
        return unfinished
