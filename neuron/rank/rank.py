"""One rank's MLX state: its group, its slice of the model, and the KV caches of its sequences.

A worker process drives one ``Rank`` from its main thread; the leader drives
rank 0's from one dedicated thread. MLX streams belong to the thread that made
them, so a ``Rank`` must stay on the thread that created its group and model.

Sequences live in two places: while their prompt is fed (possibly over several
steps, in chunks) each has a cache of its own; once the prompt is done they
join one batched cache and decode together, one token each per step. Every
change is named by the step plan, so the leader can always say what a rank
holds, and a fingerprint of that state travels back with every step.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from neuron import architectures
from neuron.models import read_config, text_config
from neuron.rank import ahead, backends, caches, rollback
from neuron.rank.agreement import disagreement
from neuron.rank.batch import Batch, fed
from neuron.rank.embed import as_sampled, embed_inputs
from neuron.rank.entries import Entries
from neuron.rank.prefill import SeqState, feed_prompts
from neuron.rank.runner import Sharded, Stage
from neuron.rank.sampler import Samplers, read, real
from neuron.rank.shard import load_shard, load_stage, parameter_count, shard_head
from neuron.rpc import Decode, Prefill, StepPlan
from neuron.sampling_params import Sampled
from neuron.step import Step


class RankError(RuntimeError):
    """A step or request refused or failed with the group still in step.

    Raised either before any collective (identically on every rank, since every
    rank checks the same request) or after all of them, so no peer is left
    waiting inside a collective. Any other exception means the group is suspect.
    """


class GroupError(RuntimeError):
    """Joining the group failed inside MLX; the message says what to check, the library's words included."""


def join_failure(backend: str, env: dict[str, str], error: Exception) -> str:
    """neuron's account of a failed join on this rank: the library's message alone (NCCL's ``invalid usage``)
    does not say that two ranks share a GPU, or which address every rank must reach."""
    said = f"{type(error).__name__}: {error}"
    if backend != "nccl":
        return f"could not join the {backend} group ({said}); check that every host reaches the others' addresses"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpu = f"CUDA_VISIBLE_DEVICES={visible}" if visible else "no CUDA_VISIBLE_DEVICES: the first GPU CUDA lists"
    rendezvous = f"{env.get('NCCL_HOST_IP', '?')}:{env.get('NCCL_PORT', '?')}"
    return (
        f"could not join the nccl group ({said}); check that this rank has a GPU of its own (it was given "
        f"{gpu}; nvidia-smi lists the host's GPUs, and no two ranks may share one), that "
        f"every host reaches rank 0's rendezvous at {rendezvous}, and that MLX for CUDA matches the driver "
        "(run with NCCL_DEBUG=INFO for NCCL's own account)"
    )


# MLX keeps one distributed group per process: a second init returns the first
# group (or a dead one after a failure). A process joins again only after
# ``Rank.leave_group`` has made MLX forget the first (``tp.backends``).
_joined_group = False


def group_joined() -> bool:
    """Whether this process has joined a group it has not left (and so cannot join another now)."""
    return _joined_group


@dataclass(slots=True)
class Loaded:
    parameters: int
    seconds: float


class Rank:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group: mx.distributed.Group | None = None
        self.model: nn.Module | None = None
        self.runner: Sharded | Stage | None = None
        self.vocab_size = 0
        self.seqs: dict[int, SeqState] = {}
        self.batch = Batch()
        self.entries = Entries()
        self._ahead: ahead.Ahead | None = None  # the next decode step, queued before its plan came
        self._unsettled: mx.array | None = None  # the step run ahead, built but not yet evaluated (``settle``)
        self._unsettled_error: Exception | None = None  # what evaluating it raised: the next step raises it
        self.prompts_together = True  # new prompts fed as one left-padded batch: where every cache can be cut
        self.embedded: dict[int, mx.array] = {}  # the last step's embedding vectors (rank 0), until ``lead`` reads them

    def init_group(self, backend: str, env: dict[str, str]) -> float:
        """Join the group and return the sanity all-reduce of 1.0 from every rank."""
        if self.world_size == 1:
            return 1.0
        global _joined_group
        if _joined_group:
            raise RankError(
                f"rank {self.rank}: this process already joined an mx.distributed group, and MLX cannot "
                "join another; start a fresh process for a new group"
            )
        os.environ.update(env)
        _joined_group = True
        try:
            group = mx.distributed.init(strict=True, backend=backend)
        except Exception as e:  # the library's own words alone: say what to check
            raise GroupError(join_failure(backend, dict(os.environ), e)) from e
        if group.rank() != self.rank or group.size() != self.world_size:
            raise RankError(
                f"joined the {backend} group as rank {group.rank()} of {group.size()}, "
                f"expected rank {self.rank} of {self.world_size}: check MLX_RANK and the hostfile"
            )
        try:
            total = real(mx.distributed.all_sum(mx.array(1.0), group=group))
        except Exception as e:  # NCCL can fail at its first collective too
            raise GroupError(join_failure(backend, dict(os.environ), e)) from e
        self.group = group
        return total

    def load(self, model_path: str, layers: list[int]) -> Loaded:
        """This rank's share of the model: a slice of every layer, or (``layers`` = [first, end)) a pipeline
        stage of whole layers."""
        if self.world_size > 1 and self.group is None:
            raise RankError(f"rank {self.rank}: load_shard before init; send init first")
        start = time.perf_counter()
        self.unload()
        config = read_config(model_path)  # the leader checked it can be split (tp.shard.check_splittable)
        self.vocab_size = text_config(config)["vocab_size"]
        if layers:
            if self.group is None:
                raise RankError(f"rank {self.rank}: a pipeline stage needs a group of at least two ranks")
            model = load_stage(model_path, layers[0], layers[1], self.rank)
        else:
            model = load_shard(model_path, self.group)
        if architectures.supports(config) is None and not all(type(c) is KVCache for c in make_prompt_cache(model)):
            raise RankError(
                f"rank {self.rank}: {model_path} ({architectures.architecture(config)!r}, outside neuron's table of "
                "architectures) builds caches other than mlx-lm's KVCache (a sliding window or a state); "
                f"serve one of {', '.join(sorted(architectures.TABLE))}"
            )
        self.model = model
        support = architectures.supports(config)
        self.prompts_together = support is None or support.cuttable  # from the whole model: a stage may hold none
        parameters = parameter_count(model)  # before a stage takes its final norm out of the tree
        if layers:
            assert self.group is not None
            self.runner = Stage(model, self.rank, self.world_size, self.group)
        else:
            self.runner = Sharded(model, shard_head(model, config.get("model_type", ""), self.group), self.rank)
        return Loaded(parameters, time.perf_counter() - start)

    # The step.

    def step(self, plan: StepPlan) -> dict[int, mx.array] | None:
        """Apply ``plan``; rank 0 gets each sequence's next-token logits (prompts just finished, and the batch),
        and keeps the vector of each embedding input finished in ``embedded``.

        A plan this rank's state cannot follow still runs, on throwaway caches of
        the same shapes, so that every peer's collectives are matched; the
        mismatch is raised after.
        """
        if self.model is None:
            raise RankError(f"rank {self.rank}: no model loaded; send load_shard first")
        for chunk in plan.prefill:
            if not chunk.tokens or not all(0 <= t < self.vocab_size for t in chunk.tokens):
                raise RankError(f"rank {self.rank}: prompt chunks need token ids in [0, {self.vocab_size})")
        if not all(0 <= t < self.vocab_size for row in plan.decode for t in (row.token, *row.draft)):
            raise RankError(f"rank {self.rank}: token ids must lie in [0, {self.vocab_size})")
        self.settle()  # a step run ahead that nobody settled yet: computed now, before anything else is queued
        if (error := self._unsettled_error) is not None:
            self._unsettled_error = None
            raise error
        queued, self._ahead = self._ahead, None
        if queued is not None and not queued.follows(plan):
            ahead.undo(self.batch.micro_batches[0].cache)
            queued = None
        if problem := disagreement(plan, self.seqs, self.batch, self.entries):
            self._shadow_step(plan)
            raise RankError(f"rank {self.rank}: desync: {problem}; clear_kv_cache to resynchronize")
        self._leave(plan.leave)
        for restore in plan.restore:
            cache = self.entries.restore(restore.entry, restore.tokens)
            self.seqs[restore.seq] = SeqState(restore.tokens, -1, cache)
        self.batch.join_rows([row for row in plan.decode if not self.batch.holds(row.seq)], self.seqs)
        assert self.runner is not None
        prompts, inputs = _split(plan)
        out = feed_prompts(self.runner, self.model, self.seqs, prompts, together=self.prompts_together)
        self.embedded = embed_inputs(self.runner, self.model, self.seqs, inputs, together=self.prompts_together)
        self.entries.evict_and_save(plan, self.seqs)
        if plan.decode and queued is not None:
            out.update(self._take_ahead(queued, plan))
        elif plan.decode:
            out.update(self._decode(plan.decode, plan.widths()))
        return out if self.rank == 0 else None

    def run_ahead(self, plan: StepPlan, drawn: dict[int, mx.array] | None = None) -> bool:
        """Queue the step after ``plan`` on the device: every row of the batch fed the token rank 0 has just drawn
        for it (``drawn``, lazy; None on the other ranks, which receive them through an all-reduce in the same
        graph). Only when the plan asks for it and the ranks split every layer; True if queued. Every rank decides
        alike from the plan and the batch it shares, so the collectives match."""
        if not plan.ahead or not isinstance(self.runner, Sharded) or set(self.batch.micro_batches) != {0}:
            return False
        rows = self.batch.micro_batches[0]
        if not ahead.can_undo(rows.cache):
            return False
        if self.rank == 0:
            assert drawn is not None
            # A row drawn nothing (its constraint failed) ends now: any token will do for the step it leaves.
            tokens = mx.stack([drawn.get(seq, mx.array(0)) for seq in rows.ids]).astype(mx.int32)
        else:
            tokens = mx.zeros((len(rows.ids),), dtype=mx.int32)
        if self.group is not None:  # rank 0's tokens on every rank's device, never through the host
            tokens = mx.distributed.all_sum(tokens, group=self.group)
        (logits,) = self.runner.logits([(tokens.reshape(-1, 1), rows.cache)], lazy=True)
        queued = tokens if logits is None else logits
        if ahead.EVALUATES_ASYNC:
            mx.async_eval(queued)
        else:
            self._unsettled = queued
        self._ahead = ahead.Ahead(list(rows.ids), tokens, queued if logits is not None else None)
        return True

    def settle(self) -> None:
        """Compute the step run ahead, where the backend evaluates in the caller (the CPU): called once this
        step's reply is on its way, so that the host's work on it (the leader's text, streams and next plan)
        runs beside the computation instead of before it. A failure (a peer lost inside its collectives) is
        raised by the next step."""
        queued, self._unsettled = self._unsettled, None
        if queued is None:
            return
        try:
            mx.eval(queued)
        except Exception as e:  # noqa: BLE001 - raised by the next step, whose reply reports it
            self._unsettled_error = e

    def ran_ahead_with(self, tokens: dict[int, int]) -> None:
        """The tokens the step run ahead was fed, now that the host has read them: its plan must name the same."""
        if self._ahead is not None:
            self._ahead.fed = [tokens[seq] for seq in self._ahead.ids]

    def _take_ahead(self, queued: ahead.Ahead, plan: StepPlan) -> dict[int, mx.array]:
        """The step run ahead is this plan's decode: its logits are computed or on their way."""
        for row in plan.decode:
            state = self.seqs[row.seq]
            state.position += 1
            state.last = row.token
        if queued.logits is None:  # not rank 0: its share of the forward is queued already
            return {}
        logits = queued.staying(plan.leave)
        return {row.seq: logits[i] for i, row in enumerate(plan.decode)}

    def fingerprint(self) -> str:
        """A digest of what this rank holds: each micro-batch's rows in order, every sequence's position and
        last token, and its prefix-cache entries' ids and lengths."""
        state = [
            self.batch.state(),
            sorted((s, q.position, q.last, q.prompt_done) for s, q in self.seqs.items()),
            self.entries.state(),
        ]
        return hashlib.blake2b(repr(state).encode(), digest_size=8).hexdigest()

    def _shadow_step(self, plan: StepPlan) -> None:
        assert self.model is not None and self.runner is not None
        prompts, inputs = _split(plan)
        feed_prompts(self.runner, self.model, self.seqs, prompts, shadow=True, together=self.prompts_together)
        embed_inputs(self.runner, self.model, self.seqs, inputs, shadow=True, together=self.prompts_together)
        passes = []
        for micro_batch, width in sorted(plan.widths().items()):
            rows = sum(row.micro_batch == micro_batch for row in plan.decode)
            passes.append((mx.zeros((rows, width), dtype=mx.int32), caches.empty_batch(self.model, rows)))
        self.runner.logits(passes, any(row.draft for row in plan.decode))

    def _leave(self, leaving: list[int]) -> None:
        for seq in leaving:
            del self.seqs[seq]
        self.batch.leave(set(leaving))

    def _decode(self, rows: list[Decode], widths: dict[int, int]) -> dict[int, mx.array]:
        """Every row's token (and draft), a pass per micro-batch; rank 0 gets each row's logits, one row of them
        per position fed where the row has a draft."""
        assert self.runner is not None
        by_seq = {row.seq: row for row in rows}
        micro_batches = sorted(widths)
        passes = []
        for micro_batch in micro_batches:
            batch = self.batch.micro_batches[micro_batch]
            rollback.drop_tail(batch.cache, [by_seq[seq].drop for seq in batch.ids])
            tokens = fed([by_seq[seq] for seq in batch.ids], widths[micro_batch])
            for seq, fed_row in zip(batch.ids, tokens, strict=True):
                state = self.seqs[seq]
                state.position += len(fed_row) - by_seq[seq].drop
                state.last = fed_row[-1]
            passes.append((mx.array(tokens), batch.cache))
        every = any(row.draft for row in rows)
        # One rank alone: its logits stay lazy, and the sampler's one read evaluates them.
        logits = self.runner.logits(passes, every, lazy=self.world_size == 1)
        out: dict[int, mx.array] = {}
        for micro_batch, batch_logits in zip(micro_batches, logits, strict=True):
            if batch_logits is not None:
                for i, seq in enumerate(self.batch.micro_batches[micro_batch].ids):
                    row = by_seq[seq]
                    if every:
                        out[seq] = batch_logits[i, : len(row.draft) + 1] if row.draft else batch_logits[i, 0]
                    else:
                        out[seq] = batch_logits[i]
        return out

    def clear_kv_cache(self, prefixes: bool = True) -> None:
        self.settle()  # every rank computes what it queued, so that the collectives in it stay matched
        self._unsettled_error = None
        self._ahead = None
        self.seqs.clear()
        self.batch.clear()
        if prefixes:
            self.entries.clear()

    def unload(self) -> None:
        self.clear_kv_cache()
        self.model = None
        self.runner = None
        backends.clear_cache()

    def leave_group(self) -> None:
        """Drop the model and the group (the model's sharded layers hold it too) and make MLX forget it, so that
        ``init_group`` can join a fresh one in this process; ``backends.NoClearBackends`` where MLX cannot."""
        self.unload()
        self.group = None
        forget_group()


def forget_group() -> None:
    """Make MLX forget this process's group, so that a fresh one can be joined here; touches no device, so that a
    rank-0 thread taking over from one wedged inside the lost group can call it (``Pool.recover``)."""
    global _joined_group
    if _joined_group:
        backends.clear_backends()
        _joined_group = False


def _split(plan: StepPlan) -> tuple[list[Prefill], list[Prefill]]:
    """The plan's prompt chunks, and its embedding inputs' chunks."""
    return [c for c in plan.prefill if not c.pool], [c for c in plan.prefill if c.pool]


def lead(rank: Rank, samplers: Samplers, step: Step) -> tuple[dict[int, Sampled], str, bool]:
    """Rank 0's whole part of a step: the forward, the tokens drawn, the next step queued where the plan allows
    (``tp.ahead``), and only then the one read that waits for the device; with its state's fingerprint, and
    whether the next step was queued."""
    draws, runs = samplers.draw(step, rank.step(step.plan) or {})
    if step.plan.ahead and ahead.EVALUATES_ASYNC:  # queued before the next step, so the read waits on them alone
        mx.async_eval([draw.arrays() for draw in draws.values()])
    queued = rank.run_ahead(step.plan, {no: draw.token for no, draw in draws.items() if draw.error is None})
    sampled = read(draws, runs) | as_sampled(rank.embedded)
    rank.ran_ahead_with({no: one.token for no, one in sampled.items()})
    return sampled, rank.fingerprint(), queued
