"""A decode step run ahead of its plan, so that the device never waits for the host in steady decode.

Why: on an accelerator a decode step takes a few milliseconds, and the host's
work between two steps (reading the tokens, delivering text, planning the next
step, the HTTP streams) would leave the device idle for most of them. So, as
mlx-lm's ``generate_step`` does, rank 0 builds the next step's forward on the
tokens it has just drawn, still lazy, and queues it (``mx.async_eval``) before
it reads them: the device computes step n+1 while the host handles step n.

The plan decides: the scheduler marks a step ``ahead`` when the next one will
most likely decode the same rows, one token each. When that next plan comes,
the rank checks it is the step it ran ahead (the same rows, less any that
leave, fed the tokens it drew) and uses the logits already computed; otherwise
it drops the token it fed from every row's cache and runs the plan as usual,
having wasted one forward. A row that finishes is fed one token more than it
needed and leaves with the next plan, as in mlx-lm.

Where the backend evaluates in the caller (MLX's CPU backend computes inside
``async_eval``), queueing would compute step n+1 before step n's tokens reach
the leader. There the rank builds the step, replies, and only then computes it
(``RunAhead.settle``): the leader's host work runs beside that computation, on
another core; a rank alone queues it then, so that its last operations run
while the rank builds the step after.

Only where every layer's cache can drop a token again (``can_undo``). Across
ranks (tensor parallel) the workers need the tokens before any host has them:
rank 0 puts them into an all-reduce every rank issues in the same graph, so
they reach every device without a round trip through the host, and the
workers queue the same step. Not in a pipeline: its micro-batches already keep
the stages busy, and a stage holds no logits to draw from.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from neuron.rank.kv import caches
from neuron.rank.kv.batch import MicroBatch
from neuron.rank.readback import ints
from neuron.rank.runner import Sliced
from neuron.rpc import StepPlan

# Whether ``mx.async_eval`` returns before the computation ends: on a GPU it does; the CPU computes in the caller.
EVALUATES_ASYNC = mx.default_device().type != mx.cpu


@dataclass(slots=True)
class Ahead:
    ids: list[int]  # the rows fed, in batch order
    tokens: mx.array  # what each was fed, on the device
    logits: mx.array | None  # (rows, vocab): the next token's logits for each, queued; rank 0 only
    fed: list[int] | None = None  # the tokens they were fed, once rank 0's host has read them

    def follows(self, plan: StepPlan) -> bool:
        """Whether ``plan`` is the step run ahead: no prompt, the same rows bar those leaving, one token each, the
        tokens drawn."""
        if plan.prefill or plan.restore or plan.save or not plan.decode:
            return False
        if any(row.draft or row.drop or row.micro_batch for row in plan.decode):
            return False
        # Rank 0 read them with the step's tokens; another rank reads them now, long computed.
        fed = dict(zip(self.ids, ints(self.tokens) if self.fed is None else self.fed, strict=True))
        staying = [seq for seq in self.ids if seq not in set(plan.leave)]
        return [row.seq for row in plan.decode] == staying and all(fed[row.seq] == row.token for row in plan.decode)

    def staying(self, leaving: list[int]) -> mx.array:
        """The logits of the rows that stay."""
        assert self.logits is not None
        if not leaving:
            return self.logits
        gone = set(leaving)
        return self.logits[mx.array([i for i, seq in enumerate(self.ids) if seq not in gone])]


class RunAhead:
    """One rank's step run ahead, from queued to taken by its plan or undone."""

    def __init__(self, rank: int, group: mx.distributed.Group | None) -> None:
        self.rank = rank
        self.group = group
        self.queued: Ahead | None = None  # the next decode step, queued before its plan came
        self._unsettled: mx.array | None = None  # built but not yet evaluated (``settle``)
        self._error: Exception | None = None  # what evaluating it raised: the next step raises it

    def queue(self, runner: Sliced, rows: MicroBatch, plan: StepPlan, drawn: dict[int, mx.array] | None) -> bool:
        """Queue the step after ``plan`` for the batch's ``rows``: each fed the token rank 0 has just drawn for it
        (``drawn``, lazy; None on the other ranks, which receive them through an all-reduce in the same graph).
        True if queued: not where the rows' caches cannot drop a token again."""
        if not can_undo(rows.cache):
            return False
        if self.rank == 0:
            assert drawn is not None
            # A row drawn nothing (its constraint failed) ends now: any token will do for the step it leaves.
            tokens = mx.stack([drawn.get(seq, mx.array(0)) for seq in rows.ids]).astype(mx.int32)
        else:
            tokens = mx.zeros((len(rows.ids),), dtype=mx.int32)
        if self.group is not None:  # rank 0's tokens on every rank's device, never through the host
            tokens = mx.distributed.all_sum(tokens, group=self.group)
        lags = {row.seq: row.rope_delta for row in plan.decode}
        adapter = {row.seq: row.adapter for row in plan.decode}
        (logits,) = runner.logits(
            [(tokens.reshape(-1, 1), rows.cache)],
            lazy=True,
            lags=[[lags.get(seq, 0) for seq in rows.ids]],
            adapters=[[adapter.get(seq, 0) for seq in rows.ids]],
        )
        queued = tokens if logits is None else logits
        if EVALUATES_ASYNC:
            mx.async_eval(queued)
        else:
            self._unsettled = queued
        self.queued = Ahead(list(rows.ids), tokens, queued if logits is not None else None)
        return True

    def settle(self, wait: bool = True) -> None:
        """Compute the step run ahead, where the backend evaluates in the caller (the CPU): called once this
        step's reply is on its way, so that the host's work on it (the leader's text, streams and next plan)
        runs beside the computation instead of before it. A failure (a peer lost inside its collectives) is
        raised by the next step (``take``).

        Without ``wait``, one rank alone queues it (``mx.async_eval``), as mlx-lm's loop does: MLX's CPU backend
        still computes most of it in this call, but returns with the last of its operations queued, and those run
        while this thread takes the next plan and builds the step after (the Python of a step's graph). Across
        ranks it is always waited for, so that no collective is left in flight between two plans."""
        queued, self._unsettled = self._unsettled, None
        if queued is None:
            return
        try:
            (mx.eval if wait or self.group is not None else mx.async_eval)(queued)
        except Exception as e:  # noqa: BLE001 - raised by the next step, whose reply reports it
            self._error = e

    def fed(self, tokens: dict[int, int]) -> None:
        """The tokens the step run ahead was fed, now that the host has read them: its plan must name the same."""
        if self.queued is not None:
            self.queued.fed = [tokens[seq] for seq in self.queued.ids]

    def take(self, plan: StepPlan, rows: MicroBatch | None) -> Ahead | None:
        """The step run ahead, settled, where ``plan`` is that step; else undone from the batch's ``rows``. Raises
        what settling it raised."""
        self.settle()  # one nobody settled yet: computed now, before anything else is queued
        if (error := self._error) is not None:
            self._error = None
            raise error
        queued, self.queued = self.queued, None
        if queued is not None and not queued.follows(plan):
            assert rows is not None
            undo(rows.cache)
            return None
        return queued

    def clear(self) -> None:
        """Every rank computes what it queued, so that the collectives in it stay matched; then forgets it."""
        self.settle()
        self._error = None
        self.queued = None


def can_undo(cache: list[BatchKVCache]) -> bool:
    """Whether a step run ahead could be taken back: plain keys and values trim; a sliding window that has
    wrapped, or a linear-attention state, cannot drop a token (those models do not run ahead)."""
    return caches.cuttable(cache)


def undo(cache: list[BatchKVCache]) -> None:
    """Drop the token a step run ahead fed every row: its plan never came."""
    for layer in cache:
        layer.trim(1)
