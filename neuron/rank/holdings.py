"""What one rank holds, and the plan's bookkeeping of it: its sequences (``SeqState``, each with its own cache while
its prompt is fed), the batch they decode in once it is done (``rank.kv.batch``), and the prefix-cache entries
(``rank.kv.entries``).

Every change is named by the step plan. Before a rank computes anything it checks that it can follow the plan
(``disagreement``); a rank that cannot still runs the step, on throwaway caches of the same shapes, so that its
peers' collectives are matched, and the leader hears a desync naming it, never a hang. A digest of what it holds
(``fingerprint``) travels back with every step: the leader compares every worker's with rank 0's. Bookkeeping
only: no forward runs here.
"""

from __future__ import annotations

import hashlib

from neuron.rank.kv import caches
from neuron.rank.kv.batch import Batch
from neuron.rank.kv.entries import Entries
from neuron.rank.kv.sequence import SeqState
from neuron.rpc import StepPlan


class Holdings:
    def __init__(self) -> None:
        self.seqs: dict[int, SeqState] = {}
        self.batch = Batch()
        self.entries = Entries()

    def disagreement(self, plan: StepPlan) -> str | None:
        """Why this rank cannot follow ``plan``, or None when it can."""
        for seq in plan.leave:
            if seq not in self.seqs:
                return f"sequence {seq} cannot leave: this rank does not hold it"
        if plan.restore or plan.evict or plan.save:
            entries = self.entries.disagreement(plan) or self.entries.disagreement_leaving(plan, self.seqs, self.batch)
            if entries:
                return entries
        return _prompts(plan, self.seqs) or _rows(plan, self.seqs, self.batch)

    def before_forward(self, plan: StepPlan) -> None:
        """The plan's leaving sequences saved where it says and gone, its restored ones back from their entries,
        and the sequences whose prompt is done joining the batch."""
        if plan.save:
            self.entries.save_leaving(plan, self.batch)
        if plan.leave:
            for seq in plan.leave:
                del self.seqs[seq]
            self.batch.leave(set(plan.leave))
        for restore in plan.restore:
            self.seqs[restore.seq] = SeqState(restore.tokens, -1, self.entries.restore(restore.entry, restore.tokens))
        joining = [row for row in plan.decode if not self.batch.holds(row.seq)]
        if joining:
            self.batch.join_rows(joining, self.seqs)

    def after_prompts(self, plan: StepPlan) -> None:
        """Once the plan's prompts are fed: its evictions, and the prompts it saves."""
        if plan.evict or plan.save:
            self.entries.evict_and_save(plan, self.seqs)

    def nbytes(self) -> int:
        """Bytes the caches hold: the sequences' own (prompts being fed), the batch's, the prefix entries'."""
        own = sum(caches.nbytes(state.cache) for state in self.seqs.values())
        batched = sum(caches.nbytes(rows.cache) for rows in self.batch.micro_batches.values())
        return own + batched + self.entries.nbytes

    def fingerprint(self) -> str:
        """Each micro-batch's rows in order, every sequence's position and last token, and the prefix-cache entries'
        ids and lengths, as a digest."""
        state = [
            self.batch.state(),
            sorted((s, q.position, q.last, q.prompt_done) for s, q in self.seqs.items()),
            self.entries.state,
        ]
        return hashlib.blake2b(repr(state).encode(), digest_size=8).hexdigest()

    def clear(self, prefixes: bool = True) -> None:
        self.seqs.clear()
        self.batch.clear()
        if prefixes:
            self.entries.clear()


def _prompts(plan: StepPlan, seqs: dict[int, SeqState]) -> str | None:
    """Each prompt chunk follows what this rank holds of its sequence."""
    left = set(plan.leave)
    restored = {r.seq: r.tokens for r in plan.restore}
    saved = {s.seq for s in plan.save}
    for chunk in plan.prefill:
        seq, position = chunk.seq, chunk.position
        if chunk.pool and (chunk.copies or seq in saved or seq in restored):
            return f"embedding input {seq} cannot be copied, saved or restored: it keeps no cache past its last chunk"
        known = seqs.get(seq)
        if seq in restored:
            if known is not None or position != restored[seq]:
                return f"sequence {seq} is restored to {restored[seq]} tokens but fed at {position} here"
            continue
        if position == 0 and known is not None:
            return f"sequence {seq} is started again but this rank already holds it"
        if position > 0 and (known is None or known.prompt_done or known.position != position or seq in left):
            held = "nothing" if known is None else f"{known.position} tokens, prompt done: {known.prompt_done}"
            return f"sequence {seq} is fed a prompt chunk at {position} but this rank holds {held}"
        if chunk.copies and (not chunk.last or any(c in seqs or c == seq for c in chunk.copies)):
            return f"sequence {seq} cannot be copied to {chunk.copies}: not its last chunk, or a copy exists"
    return None


def _rows(plan: StepPlan, seqs: dict[int, SeqState], batch: Batch) -> str | None:
    """Each micro-batch keeps its rows in order, and only sequences whose prompt is done here join one."""
    left = set(plan.leave)
    for micro_batch in sorted({row.micro_batch for row in plan.decode} | set(batch.micro_batches)):
        staying = [s for s in batch.ids(micro_batch) if s not in left]
        rows = [row.seq for row in plan.decode if row.micro_batch == micro_batch]
        if rows[: len(staying)] != staying:
            return f"micro-batch {micro_batch} here is {staying}, the plan decodes {rows} in it"
        for seq in rows[len(staying) :]:
            known = seqs.get(seq)
            if known is None or not known.prompt_done or seq in left or batch.holds(seq):
                return f"sequence {seq} cannot join micro-batch {micro_batch}: its prompt is not done here"
    return None
