"""Whether a rank's state can follow a step's plan, and, where it cannot, what to say.

Every rank checks the same plan against what it holds before it computes
anything. A rank that cannot follow still runs the step, on throwaway caches of
the same shapes (``Rank._shadow_step``), so that its peers' collectives are
matched, and raises the problem after: the leader hears a desync naming the
rank, never a hang. Bookkeeping only: no MLX runs here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from neuron.rpc import StepPlan

if TYPE_CHECKING:
    from neuron.rank.kv.batch import Batch
    from neuron.rank.kv.entries import Entries
    from neuron.rank.prefill import SeqState


def disagreement(plan: StepPlan, seqs: dict[int, SeqState], batch: Batch, entries: Entries) -> str | None:
    """Why this rank cannot follow ``plan``, or None when it can."""
    for seq in plan.leave:
        if seq not in seqs:
            return f"sequence {seq} cannot leave: this rank does not hold it"
    return (
        entries.disagreement(plan)
        or entries.disagreement_leaving(plan, seqs, batch)
        or _prompts(plan, seqs)
        or _rows(plan, seqs, batch)
    )


def _prompts(plan: StepPlan, seqs: dict[int, SeqState]) -> str | None:
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
