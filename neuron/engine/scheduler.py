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
from dataclasses import dataclass

from neuron.engine.prefix import PrefixIndex
from neuron.engine.sequence import Overloaded, Sequence
from neuron.engine.speculate import StepCost, width
from neuron.rpc import Decode, Evict, Prefill, Restore, Save, StepPlan
from neuron.sampling_params import PENALTY_WINDOW, Sampled, SamplingParams


@dataclass(frozen=True, slots=True)
class Limits:
    """The serving limits; these defaults are ``neuron serve``'s (config.py reads them from here)."""

    max_batch: int = 8  # sequences decoding together; more wait in the queue
    max_waiting: int = 64  # requests queued beyond the batch; more get 429
    prefill_chunk: int = 512  # prompt tokens fed per step, across all prompts being fed
    max_context: int | None = None  # tokens per request (prompt + completion); None: the model's own
    micro_batches: int = 1  # decode passes per step: a pipeline's stages then work at once
    prefix_cache_bytes: int = 1 << 30  # the prefix cache's budget on the rank holding the largest share; 0: off
    max_n: int = 8  # choices per request (n), each a sequence of the batch: at most max_batch
    speculate: str = "ngram"  # draft tokens from prompt lookup and ``prediction`` (engine.speculate); "off": none


@dataclass(frozen=True, slots=True)
class Delivery:
    """A token sampled for ``seq`` in a step, and whether it ends the sequence.

    ``finish`` is ``"stop"`` for an end-of-sequence token (which is not part of
    the text), ``"length"`` for the last token ``max_tokens`` allows, else None.
    ``first`` marks the token sampled from the end of the prompt. ``"error"``: the
    sequence's output constraint failed (``sampled.error``); it ends with that error.
    """

    seq: Sequence
    sampled: Sampled
    finish: str | None
    first: bool


class Scheduler:
    def __init__(
        self, limits: Limits, eos_token_ids: set[int] | frozenset[int], prefix: PrefixIndex | None = None
    ) -> None:
        self.limits = limits
        self.prefix = prefix  # None: no prefix cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.steps = 0  # steps applied; cancellations are measured against it
        self.waiting: deque[Sequence] = deque()
        self.filling: list[Sequence] = []  # admitted, prompt being fed
        self.running: list[Sequence] = []  # decoding, in batch order
        self.leaving: list[int] = []  # sequences every rank drops in the next plan
        self.cost = StepCost()  # what a decode step costs, for the drafts' width; the engine refines it

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

    def drop_cancelled(self) -> list[Sequence]:
        """Take the cancelled sequences out of the batch (they leave in the next plan); returns them."""
        dropped = [seq for seq in self.batch if seq.cancelled_at is not None]
        for seq in dropped:
            self.remove(seq)
        return dropped

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the batch, in arrival order, while it has places; returns them."""
        admitted = []
        while self.waiting and len(self.filling) + len(self.running) + self.waiting[0].n <= self.limits.max_batch:
            seq = self.waiting.popleft()
            self.filling += [seq, *seq.copies]
            admitted += [seq, *seq.copies]
        return admitted

    def plan(self) -> StepPlan | None:
        """The next step: who leaves, which prompt chunks are fed, every running sequence's next input.

        None when nothing is admitted (``leaving`` may still name sequences to drop).
        """
        if not self.filling and not self.running:
            return None
        budget = self.limits.prefill_chunk
        prefill, restore = [], []
        for seq in self.filling:
            if budget <= 0:
                break
            if seq.copy_of is not None:
                continue  # fed when its original's prompt ends
            start = seq.fed
            scores = seq.params.prompt_logprobs is not None  # a restored prefix would leave its tokens unscored
            prefix = self.prefix if not scores else None
            if start == 0 and prefix is not None and (hit := prefix.lookup(seq.prompt)) is not None:
                restore.append(Restore(seq.no, hit.entry, hit.tokens))
                start = hit.tokens  # restored, not computed: outside the budget
            take = min(budget, len(seq.prompt) - start)
            end = start + take
            last = end == len(seq.prompt)
            copies = [c.no for c in seq.copies if c in self.filling] if last else []
            prefill.append(Prefill(seq.no, start, seq.prompt[start:end], last, copies, scores))
            budget -= take
        decode = self._decode()
        plan = StepPlan(leave=list(self.leaving), prefill=prefill, decode=decode, restore=restore)
        # Saved only after every lookup: a rank restores before it saves, so no plan may restore what it saves.
        by_no = {seq.no: seq for seq in self.filling}
        for chunk in prefill:
            if chunk.last and self.prefix is not None and (stored := self.prefix.store(by_no[chunk.seq].prompt)):
                plan.save.append(Save(chunk.seq, stored.entry))
                plan.evict.extend(Evict(entry) for entry in stored.evicted)
        return plan

    def joining(self, plan: StepPlan) -> dict[int, SamplingParams]:
        """The sampling parameters of the sequences ``plan`` starts: rank 0 makes their samplers."""
        by_no = {seq.no: seq for seq in self.filling}
        restored = {r.seq for r in plan.restore}
        starting = [
            no for c in plan.prefill for no in ([c.seq] if c.position == 0 or c.seq in restored else []) + c.copies
        ]
        return {no: by_no[no].params for no in starting}

    def restored(self, plan: StepPlan) -> dict[int, list[int]]:
        """The last prompt tokens each prefix restored by ``plan`` covers: the penalties look at them."""
        by_no = {seq.no: seq for seq in self.filling}
        return {r.seq: by_no[r.seq].prompt[max(0, r.tokens - PENALTY_WINDOW) : r.tokens] for r in plan.restore}

    def apply(self, plan: StepPlan, sampled: dict[int, Sampled]) -> list[Delivery]:
        """What ``plan``'s step did, now that every rank ran it: prompts fed, tokens sampled, in plan order.

        A sequence missing from the batch was taken out while the step ran
        (cancelled, or failed by a shutdown): its token is not delivered.
        """
        self.steps += 1
        self.leaving.clear()
        if self.prefix is not None:
            self.prefix.unpin()
        by_no = {seq.no: seq for seq in self.batch}
        for restore in plan.restore:
            if (seq := by_no.get(restore.seq)) is not None:
                seq.fed = seq.cached = restore.tokens
        out = []
        for chunk in plan.prefill:
            if (seq := by_no.get(chunk.seq)) is None:
                continue
            seq.fed += len(chunk.tokens)
            if chunk.last:
                for copy in [seq, *(by_no[no] for no in chunk.copies if no in by_no)]:
                    copy.fed = len(copy.prompt)
                    self.filling.remove(copy)
                    copy.group = self._smallest_group()
                    self.running.append(copy)
                    out.append(self._outcome(copy, sampled[copy.no], first=True))
        widths = {row.group: 0 for row in plan.decode}  # each micro-batch's rows were fed this many tokens
        for row in plan.decode:
            widths[row.group] = max(widths[row.group], 1 + len(row.draft))
        for row in plan.decode:
            if (seq := by_no.get(row.seq)) is None:
                continue
            run = [sampled[row.seq], *sampled[row.seq].more]  # the token, then those a kept draft adds
            for one in run:
                out.append(self._outcome(seq, one, first=False))
                if out[-1].finish is not None:
                    break
            seq.drop = widths[row.group] - len(run)  # fed but not kept: the draft's rejected tail, the padding
            if seq.proposer is not None:  # what was verified: a draft the width cut is not a miss
                seq.proposer.update(len(row.draft), len(run) - 1)
        return out

    def _decode(self) -> list[Decode]:
        """Every running sequence's row: its token, and its draft cut to the width its micro-batch pays for."""
        drafts = {seq.no: self._draft(seq) for seq in self.running}
        share = 1 / self.limits.micro_batches  # each micro-batch's part of the step's fixed time
        for group in range(self.limits.micro_batches):
            rows = [seq for seq in self.running if seq.group == group]
            estimates = [(len(drafts[seq.no]), seq.proposer.acceptance if seq.proposer else 0.0) for seq in rows]
            cut = width(estimates, self.cost, share) - 1
            for seq in rows:
                drafts[seq.no] = drafts[seq.no][:cut]
        return [Decode(seq.no, seq.next_token, seq.group, drafts[seq.no], seq.drop) for seq in self.running]

    def _draft(self, seq: Sequence) -> list[int]:
        """The tokens ``seq`` proposes after its next one: never more than ``max_tokens`` leaves room for."""
        if seq.proposer is None or seq.next_token is None:
            return []
        room = seq.max_tokens - seq.completion_tokens - 1
        return seq.proposer.propose(seq.prompt + seq.output, seq.output, room)

    def _smallest_group(self) -> int:
        """The micro-batch a sequence joins: the one with the fewest rows (the first of those), so passes stay even."""
        sizes = [0] * self.limits.micro_batches
        for seq in self.running:
            sizes[seq.group] += 1
        return sizes.index(min(sizes))

    def _outcome(self, seq: Sequence, sampled: Sampled, *, first: bool) -> Delivery:
        if sampled.error is not None:
            return Delivery(seq, sampled, "error", first)
        if seq.max_tokens == 0:  # the prompt, scored, was all it asked for: the token is not used
            return Delivery(seq, sampled, "length", first)
        params = seq.params
        if sampled.token in params.stop_token_ids or (sampled.token in self.eos_token_ids and not params.ignore_eos):
            return Delivery(seq, sampled, "stop", first)
        seq.completion_tokens += 1
        seq.next_token = sampled.token
        if seq.proposer is not None:
            seq.output.append(sampled.token)
        return Delivery(seq, sampled, "length" if seq.completion_tokens >= seq.max_tokens else None, first)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the batch; the ranks drop it in the next plan, if any of its prompt reached them."""
        for group in (self.filling, self.running):
            if seq in group:
                group.remove(seq)
                if seq.fed:
                    self.leaving.append(seq.no)

    def clear(self) -> list[Sequence]:
        """Forget every request, queued or admitted (the ranks' caches are cleared); returns those unfinished."""
        unfinished = [seq for seq in (*self.waiting, *self.batch) if not seq.finished]
        self.waiting.clear()
        self.filling.clear()
        self.running.clear()
        self.leaving.clear()
        if self.prefix is not None:
            self.prefix.unpin()
        return unfinished
