"""One rank's MLX state: its group, its slice of the model, and the KV caches of its sequences.

A worker process drives one ``Rank`` from its main thread; the leader drives
rank 0's from one dedicated thread. MLX streams belong to the thread that made
them, so a ``Rank`` must stay on the thread that created its group and model.

Sequences live in two places: while their prompt is fed (possibly over several
steps, in chunks) each has a cache of its own; once the prompt is done they
join one batched cache and decode together, one token each per step. Every
change is named by the step plan, so the leader can always say what a rank
holds, and a fingerprint of that state travels back with every step.

A step is one function on every rank, ``run`` (below), as nano-vllm's model
runner: every rank runs the step's forward (its collectives must match), and
only rank 0, which holds the logits, draws the tokens. Then, where the plan
allows, every rank queues the next decode step (``rank.ahead``): rank 0 feeds it
the tokens it has just drawn, still on the device, and the others receive them
through an all-reduce in the same graph. Only after that does rank 0 read its
tokens (the step's one wait on the device), and every rank returns the digest
of what it holds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

from neuron.images import Inputs
from neuron.models.adapters import AdapterError, find
from neuron.rank import ahead
from neuron.rank.dist import backends, group
from neuron.rank.embed import as_sampled, embed_inputs
from neuron.rank.failures import GroupError, RankError
from neuron.rank.head.head import Head
from neuron.rank.head.sampler import read
from neuron.rank.holdings import Holdings
from neuron.rank.kv import caches, rollback, states
from neuron.rank.kv.batch import row_inputs
from neuron.rank.kv.disk import Disk
from neuron.rank.model.load import Loaded, load
from neuron.rank.model.lora import Adapters
from neuron.rank.prefill import feed_prompts
from neuron.rank.runner import Sliced, Stage
from neuron.rpc import Decode, Prefill, StepPlan
from neuron.step import Sampled, Step
from neuron.system import cpu, device

__all__ = ["GroupError", "Loaded", "Rank", "RankError", "Stepped", "run"]


class Rank:
    def __init__(self, rank: int, world_size: int, cores: list[int] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        # The cores this rank's products may compute on (the quantized kernel's threads, ``rank.model.kernels``):
        # its thread's own, unless rank 0 alone keeps its thread to one core and leaves the others to the products.
        self.cores = cores if cores is not None else cpu.allowed_cores()
        self.group: mx.distributed.Group | None = None
        self.model: nn.Module | None = None
        self.runner: Sliced | Stage | None = None
        self.vocab_size = 0
        self.held = Holdings()
        self.ahead = ahead.RunAhead(rank, None)  # the next decode step, queued before its plan came
        self.prompts_together = True  # new prompts fed as one left-padded batch: where every cache can be cut
        self.recording = False  # the model's gated delta layers record each position's state (``rank.kv.states``)
        self.embedded: dict[int, mx.array] = {}  # the last step's embedding vectors (rank 0), until ``run`` reads
        self.adapters: Adapters | None = None  # the LoRA adapters loaded (``rank.model.lora``), once a model is
        self.kernel: ModuleType | None = None  # neuron's CPU kernels, where the model's products go through them
        # The most one step has taken beyond what the rank held before and after it (its activations, a joining
        # batch's copies), since the model loaded: what the leader's memory budget keeps free for steps.
        self.peak = 0

    def init_group(self, backend: str, env: dict[str, str], files: dict[str, str]) -> float:
        """Join the group (``rank.dist.group``) and return the sanity all-reduce of 1.0 from every rank."""
        if self.world_size == 1:
            return 1.0
        self.group, total = group.join(self.rank, self.world_size, backend, env, files)
        self.ahead = ahead.RunAhead(self.rank, self.group)
        return total

    def load(self, model_path: str, layers: list[int], kv_bits: int | None = None) -> Loaded:
        """This rank's share of the model (``rank.model.load``): a slice of every layer, or (``layers`` = [first, end))
        a pipeline stage of whole layers; its KV caches quantized to ``kv_bits`` (``--kv-bits``) where given."""
        if self.world_size > 1 and self.group is None:
            raise RankError(f"rank {self.rank}: load_share before init; send init first")
        start = time.perf_counter()
        self.unload()
        share = load(model_path, layers, self.rank, self.world_size, self.group, kv_bits, self.cores)
        self.held.entries.kv_bits = kv_bits
        self.peak = 0
        self.model, self.runner, self.vocab_size = share.model, share.runner, share.vocab_size
        self.prompts_together, self.recording = share.prompts_together, share.recording
        self.kernel = share.kernel
        split = self.group if not layers else None  # a stage holds whole layers: its adapters too
        self.adapters = Adapters(share.model, split, layers[0] if layers else 0, share.layers, share.runner.selection)
        return Loaded(share.parameters, time.perf_counter() - start)

    def load_adapter(self, number: int, name: str, path: str) -> int:
        """Load the LoRA adapter at ``path`` as ``number`` (``rank.model.lora``): this rank's slice of it. Returns how
        many of this rank's projections it adapts."""
        if self.adapters is None:
            raise RankError(f"rank {self.rank}: no model loaded; send load_share before load_adapter")
        self.ahead.settle()  # a step run ahead was built with the projections as they are
        try:
            spec = find(name, path)
        except AdapterError as e:
            raise RankError(f"rank {self.rank}: {e}") from None
        try:
            return self.adapters.load(number, spec)
        except RankError as e:
            raise RankError(f"rank {self.rank}: {e}") from None

    def unload_adapter(self, number: int) -> None:
        if self.adapters is not None:
            self.ahead.settle()
            self.adapters.unload(number)

    # The step.

    def step(self, plan: StepPlan, pixels: Mapping[str, Inputs] | None = None) -> dict[int, mx.array] | None:
        """Apply ``plan``; rank 0 gets each sequence's next-token logits (prompts just finished, and the batch),
        and keeps the vector of each embedding input finished in ``embedded``. ``pixels``: rank 0's, the inputs of
        the images its encoder turns into the features the plan's chunks put in (``Step.images``).

        A plan this rank's state cannot follow still runs, on throwaway caches of
        the same shapes, so that every peer's collectives are matched; the
        mismatch is raised after.
        """
        if self.model is None:
            raise RankError(f"rank {self.rank}: no model loaded; send load_share first")
        for chunk in plan.prefill:
            if not chunk.tokens or not all(0 <= t < self.vocab_size for t in chunk.tokens):
                raise RankError(f"rank {self.rank}: prompt chunks need token ids in [0, {self.vocab_size})")
        if not all(0 <= t < self.vocab_size for row in plan.decode for t in (row.token, *row.draft)):
            raise RankError(f"rank {self.rank}: token ids must lie in [0, {self.vocab_size})")
        queued = self.ahead.take(plan, self.held.batch.micro_batches.get(0))
        if problem := self.held.disagreement(plan):
            self._shadow_step(plan)
            raise RankError(f"rank {self.rank}: desync: {problem}; clear_kv_cache to resynchronize")
        self.held.before_forward(plan)
        assert self.runner is not None
        out: dict[int, mx.array] = {}
        self.embedded = {}
        if plan.prefill:
            prompts, inputs = _split(plan)
            seqs, together = self.held.seqs, self.prompts_together
            out = feed_prompts(self.runner, self.model, seqs, prompts, together=together, pixels=pixels)
            self.embedded = embed_inputs(self.runner, self.model, seqs, inputs, together=together)
        self.held.after_prompts(plan)
        if plan.decode and queued is not None:
            out.update(self._take_ahead(queued, plan))
        elif plan.decode:
            out.update(self._decode(plan.decode, plan.widths()))
        if self.runner.images is not None and (gone := self.runner.images.take_missing()):
            raise RankError(f"rank {self.rank}: {gone}")  # after every collective: no peer is left waiting
        return out if self.rank == 0 else None

    def run_ahead(self, plan: StepPlan, drawn: dict[int, mx.array] | None = None) -> bool:
        """Queue the step after ``plan`` on the device: every row of the batch fed the token rank 0 has just drawn
        for it (``drawn``, lazy; None on the other ranks, which receive them through an all-reduce in the same
        graph). Only when the plan asks for it and the ranks split every layer; True if queued. Every rank decides
        alike from the plan and the batch it shares, so the collectives match."""
        if not plan.ahead or not isinstance(self.runner, Sliced) or set(self.held.batch.micro_batches) != {0}:
            return False
        return self.ahead.queue(self.runner, self.held.batch.micro_batches[0], plan, drawn)

    def _take_ahead(self, queued: ahead.Ahead, plan: StepPlan) -> dict[int, mx.array]:
        """The step run ahead is this plan's decode: its logits are computed or on their way."""
        for row in plan.decode:
            state = self.held.seqs[row.seq]
            state.position += 1
            state.last = row.token
            state.saw(None, [], state.position)  # its hidden states were not kept: the next draft waits for a step's
        if queued.logits is None:  # not rank 0: its share of the forward is queued already
            return {}
        logits = queued.staying(plan.leave)
        return {row.seq: logits[i] for i, row in enumerate(plan.decode)}

    def limit_memory(self, memory_limit: int, cache_limit: int) -> None:
        """Keep MLX within the leader's budget where it enforces its limits (Metal, CUDA: an allocation past them
        fails, which fails a step, not the process); MLX's CPU backend stores them and enforces neither."""
        if device.backend() != "cpu":
            mx.set_memory_limit(memory_limit)
            mx.set_cache_limit(cache_limit)

    def _shadow_step(self, plan: StepPlan) -> None:
        assert self.model is not None and self.runner is not None
        prompts, inputs = _split(plan)
        seqs = self.held.seqs
        feed_prompts(self.runner, self.model, seqs, prompts, shadow=True, together=self.prompts_together)
        embed_inputs(self.runner, self.model, seqs, inputs, shadow=True, together=self.prompts_together)
        passes = []
        for micro_batch, width in sorted(plan.widths().items()):
            rows = sum(row.micro_batch == micro_batch for row in plan.decode)
            passes.append((mx.zeros((rows, width), dtype=mx.int32), caches.empty_batch(self.model, rows)))
        self.runner.logits(passes, any(row.draft for row in plan.decode))

    def _decode(self, rows: list[Decode], widths: dict[int, int]) -> dict[int, mx.array]:
        """Every row's token (and draft), a pass per micro-batch; rank 0 gets each row's logits, one row of them
        per position fed where the row has a draft."""
        assert self.runner is not None
        by_seq = {row.seq: row for row in rows}
        micro_batches = sorted(widths)
        passes, lags = [], []
        adapters = []
        for micro_batch in micro_batches:
            batch = self.held.batch.micro_batches[micro_batch]
            lags.append([by_seq[seq].rope_delta for seq in batch.ids])
            if any(drops := [by_seq[seq].drop for seq in batch.ids]):
                rollback.drop_tail(batch.cache, drops)
            if self.recording:
                states.record_each_position(batch.cache, widths[micro_batch] > 1)
            tokens = row_inputs([by_seq[seq] for seq in batch.ids], widths[micro_batch])
            for seq, fed_row in zip(batch.ids, tokens, strict=True):
                state = self.held.seqs[seq]
                state.position += len(fed_row) - by_seq[seq].drop
                state.last = fed_row[-1]
            passes.append((mx.array(tokens), batch.cache))
            adapters.append([by_seq[seq].adapter for seq in batch.ids])
        every = any(row.draft for row in rows)
        # One rank alone: its logits stay lazy, and the sampler's one read evaluates them.
        logits = self.runner.logits(passes, every, lazy=self.world_size == 1, lags=lags, adapters=adapters)
        for micro_batch in micro_batches if self.recording else ():
            states.stop_recording(self.held.batch.micro_batches[micro_batch].cache)
        out: dict[int, mx.array] = {}
        hidden: list[mx.array | None] = [*self.runner.kept_states] or [None] * len(micro_batches)
        for micro_batch, batch_logits, batch_hidden in zip(micro_batches, logits, hidden, strict=True):
            if batch_logits is not None:
                for i, seq in enumerate(self.held.batch.micro_batches[micro_batch].ids):
                    row = by_seq[seq]
                    if batch_hidden is not None:
                        state = self.held.seqs[seq]
                        at = state.position - widths[micro_batch]
                        state.saw(batch_hidden[i, : len(row.draft) + 1], [row.token, *row.draft], at)
                    if every:
                        out[seq] = batch_logits[i, : len(row.draft) + 1] if row.draft else batch_logits[i, 0]
                    else:
                        out[seq] = batch_logits[i]
        return out

    def clear_kv_cache(self, prefixes: bool = True) -> None:
        self.ahead.clear()
        self.held.clear(prefixes)

    def open_disk(self, folder: str, budget: int, stamp: str) -> dict[str, int]:
        """Spill entries to ``folder`` from now on (``rank.kv.disk``); returns the files there this rank may load."""
        entries = self.held.entries
        if entries.disk is not None:
            entries.disk.close(0.0)
        entries.disk = Disk(Path(folder), budget, stamp, self.rank, entries.kv_bits)
        return entries.disk.scan()

    def flush_disk(self, timeout: float) -> bool:
        return self.held.entries.disk is None or self.held.entries.disk.flush(timeout)

    def unload(self) -> None:
        self.clear_kv_cache()
        self.model = None
        self.runner = None
        self.adapters = None
        self.kernel = None
        backends.clear_cache()

    def leave_group(self) -> None:
        """Drop the model and the group (the model's sharded layers hold it too) and make MLX forget it
        (``rank.dist.group.leave``), so that ``init_group`` can join a fresh one in this process."""
        self.unload()
        self.group = None
        self.ahead = ahead.RunAhead(self.rank, None)
        group.leave()


@dataclass(frozen=True, slots=True)
class Stepped:
    """What a step left on one rank."""

    fingerprint: str  # the digest of the rank's state, which every worker's must match
    queued: bool  # whether the next step was run ahead
    sampled: dict[int, Sampled] = field(default_factory=dict)  # rank 0's draws, by sequence; empty elsewhere


# Tasks MLX's CPU evaluation may queue beyond its own ten during a step that decodes one sequence (``queue_more`` in
# quantized.cpp). A task is ten of the stream's dispatches, and a node takes two or three (its computing, then
# releasing its inputs): enough for a small model's whole step, whose stream then computes while rank 0 builds the
# rest of it and the leader plans the next. What one sequence's rows hold ahead is small beside the weights. Only
# one: with eight streams decoding, steps queued whole were slower (BENCHMARKS.md, "A decode step queued whole"; most
# likely rank 0's thread, no longer held, takes the interpreter from the event loop that writes the streams).
DECODE_TASKS = 200


@contextmanager
def decode_queue(kernel: ModuleType | None, lone: bool) -> Iterator[None]:
    """Within it, MLX's CPU evaluation queues ``DECODE_TASKS`` more tasks before it holds its caller, where the step
    is ``lone`` (it decodes one sequence and feeds no prompt) and the kernel is loaded."""
    if kernel is None or not lone:
        yield
        return
    kernel.queue_more(DECODE_TASKS)
    try:
        yield
    finally:
        kernel.queue_more(-DECODE_TASKS)


def run(rank: Rank, step: Step, head: Head | None = None) -> Stepped:
    """Run ``step`` on ``rank``; with ``head`` (rank 0's), draw each sequence's tokens too. The most the step
    takes beyond what the rank holds before and after it raises ``rank.peak``."""
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    try:
        with decode_queue(rank.kernel, lone=not step.plan.prefill and len(step.plan.decode) == 1):
            return _run(rank, step, head)
    finally:
        transient = mx.get_peak_memory() - max(before, mx.get_active_memory())
        rank.peak = max(rank.peak, transient)


def _run(rank: Rank, step: Step, head: Head | None) -> Stepped:
    logits = rank.step(step.plan, step.images) or {}
    if head is None:
        queued = rank.run_ahead(step.plan)  # queued or only built (``RunAhead.settle``), not waited for
        return Stepped(rank.held.fingerprint(), queued)
    draws, runs = head.draw(step, logits)
    if step.plan.ahead and ahead.EVALUATES_ASYNC:  # queued before the next step, so the read waits on them alone
        mx.async_eval([draw.arrays() for draw in draws.values()])
    queued = rank.run_ahead(step.plan, {no: draw.token for no, draw in draws.items() if draw.error is None})
    sampled = read(draws, runs)
    if rank.embedded:
        sampled |= as_sampled(rank.embedded)
    rank.ahead.fed({no: one.token for no, one in sampled.items()})
    return Stepped(rank.held.fingerprint(), queued, sampled)


def _split(plan: StepPlan) -> tuple[list[Prefill], list[Prefill]]:
    """The plan's prompt chunks, and its embedding inputs' chunks."""
    return [c for c in plan.prefill if not c.pool], [c for c in plan.prefill if c.pool]
