"""The engine: one task owns the pool and runs every step; requests share each step as a batch.

Why one task: the pool's ranks must see the same steps in the same order, so
exactly one caller may drive it. Requests never touch the pool; they queue a
``Sequence`` and read its events. The scheduler decides each step's plan; the
engine runs it, turns the sampled tokens into text, and handles failures.

Why cancellation waits for the step boundary: a step handed to the workers
must finish on every rank (the pool shields it), or a rank is left inside a
collective. A caller that goes away only marks its sequence; the loop drops it
before the next step (it leaves in that step's plan); the others keep going.

Readiness: the engine is ready once a probe step has succeeded on every rank
since the last failure. A failed step (or a desync) fails the sequences in the
batch, clears every rank's cache, makes the engine unready (requests get 503),
and probes again at once, then every few seconds until a probe passes.

A lost group (a rank died, hung, was cut off) fails nothing at first: the batch
is paused (``engine.resume``), the pool replaces every worker and rank 0's
group in this process, and each paused sequence is fed its prompt and output
so far again and goes on; meanwhile new requests queue. Where the pool cannot
recover in this process, or with ``resume_timeout`` 0, every request fails and
``lost`` is set: the leader restarts its process.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import structlog

from neuron import images, metrics
from neuron.config.settings import KV_GROUP_SIZE
from neuron.engine.adapter_registry import Adapters
from neuron.engine.drafts import DRAFTED
from neuron.engine.intake import Intake
from neuron.engine.memory import Budget, Share
from neuron.engine.output import Output
from neuron.engine.prefix import PrefixIndex
from neuron.engine.prefix_disk import PrefixDisk
from neuron.engine.pressure import Pressure
from neuron.engine.recent import Recent
from neuron.engine.recovery import Health, Recovering
from neuron.engine.refusals import Unavailable
from neuron.engine.scheduler import Scheduler, Scheduling, ahead_for
from neuron.engine.sequence import Sequence
from neuron.engine.text import Text
from neuron.grammar import Grammars
from neuron.log import progress, trace
from neuron.models import architectures
from neuron.models.architectures import mtp_heads
from neuron.models.folder import ModelError, embedding, read_config, resolve, text_config
from neuron.pool import Deadlines, Layout, Pool, PoolError
from neuron.rpc import StepPlan
from neuron.sampling_params import SamplingParams
from neuron.step import DraftRow, Step
from neuron.system import device

log = structlog.get_logger("neuron.engine")

REPROBE_S = 5.0
EVENTS_KEPT = 20


class Engine(Recovering):
    """Requests in, events out, and the one loop that drives the pool; a lost group's handling is
    ``Recovering``'s (engine.recovery)."""

    def __init__(self, pool: Pool, text: Text, config: dict[str, Any], limits: Scheduling | None = None) -> None:
        model = text_config(config)
        self.pool = pool
        self.text = text
        self.vision = text.vision is not None  # the model takes images (the page offers to attach one)
        # What this model's caches cannot do is off, whatever was asked, and the startup log says why.
        self.limits, notes = architectures.limits_for(config, limits or Scheduling())
        for note in notes:
            log.info(note)
        if self.limits.run_ahead == "auto":
            self.limits = dataclasses.replace(
                self.limits, run_ahead=ahead_for(device.backend(), pool.world_size, self.limits.micro_batches)
            )
        model_context = int(model.get("max_position_embeddings") or 4096)
        self.context_length = min(model_context, self.limits.max_context or model_context)
        self.vocab_size = int(model["vocab_size"])
        self.embedding = embedding(pool.model_path, config, self.limits.pooling_type)
        # Compiles requests' output constraints (on a caller's thread); rank 0's sampler applies them.
        self.grammars = Grammars(text.tokenizer._tokenizer, self.vocab_size, sorted(text.eos_token_ids))
        self.health = Health(False, "not probed yet")
        # Set once the group is lost for good (lost, and not recovered in this process): only a fresh leader
        # process can serve again.
        self.lost = anyio.Event()
        self._in_flight: Step | None = None  # the step the pool is running, whom a loss is blamed on
        self.recoveries = 0  # lost groups replaced in this process
        # The latest losses and recoveries, as the status route shows them: a poll may fall between the two.
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self.recent = Recent()  # the steps of the last minutes, for the status route's charts
        self.budget, self.prefix, self.disk = _caches(config, self.limits, pool, self.context_length)
        self.scheduler = Scheduler(self.limits, text.eos_token_ids, self.prefix, self.budget)
        self.scheduler.spill = self.disk is not None
        self.output = Output(text, self.scheduler.finish, self.prefix is not None)
        store = images.STORE if self.vision else None
        self.pressure = Pressure(pool, self.budget, self.scheduler, self.output, self.vocab_size, store)
        eos = frozenset(text.eos_token_ids)
        self.intake = Intake(self.limits, self.context_length, self.vocab_size, eos, text.tokenizer, self.budget)
        # The LoRA adapters served, by name; one that requests queued or running use stays.
        self.adapters = Adapters(pool, lambda: (*self.scheduler.waiting, *self.scheduler.batch))
        self._accepting = True
        self._wakeup = anyio.Event()
        self._idle = anyio.Event()
        self._busy_since: float | None = None  # when the loop's current pool call began; None while it waits
        self._probe_failed = False  # True while the loop waits to probe again
        metrics.WAITING.set_function(lambda: self.waiting)
        metrics.RUNNING.set_function(lambda: self.running)
        metrics.READY.set_function(lambda: float(self.health.ready))
        metrics.PREFIX_BYTES.set_function(lambda: self.prefix.bytes if self.prefix else 0)
        metrics.KV_CACHE_USAGE.set_function(self.pressure.usage)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model_path: Path,
        layout: Layout | None = None,
        deadlines: Deadlines | None = None,
        limits: Scheduling | None = None,
        model: str | None = None,
        adapters: list[tuple[str, str]] | None = None,
    ) -> AsyncIterator[Engine]:
        """Spawn the ranks (one, on this host, without a ``layout``), load the model and its LoRA ``adapters``
        (name, folder or Hub name), probe it, and run the step loop until the block exits. ``model`` is what
        ``--model`` said, for hosts that resolve it themselves."""
        config = read_config(model_path)
        text = Text.load(model_path)
        limits = limits or Scheduling()
        draft = await _draft_model(config, text, limits, model or model_path.name)
        async with Pool(model_path, layout, deadlines, model) as pool:
            pool.draft_path = draft
            pool.mtp = limits.speculate == "mtp"
            pool.kv_bits = limits.kv_bits
            with progress(f"loading {model_path.name} on {pool.world_size} rank(s)", 1) as advance:
                await pool.load()
                advance()
            engine = cls(pool, text, config, limits)
            for name, where in adapters or []:
                await engine.adapters.load(name, where)
            # The first probe feeds a whole chunk: what a step takes on each rank beyond its caches (``engine.memory``).
            if not await engine._probe(engine.budget.chunk):
                raise ModelError(f"the model loaded but its first step failed: {engine.health.reason}")
            await engine.pressure.read(calibrate=True)
            if engine.disk is not None and engine.prefix is not None:
                await engine.disk.restore(pool, engine.prefix)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(engine._loop)
                    tg.start_soon(pool.watch, engine._on_lost)
                    try:
                        yield engine
                    finally:
                        engine.abort("the server is shutting down")
                        tg.cancel_scope.cancel()
            finally:
                if engine.disk is not None and engine.prefix is not None:
                    with anyio.CancelScope(shield=True):
                        await engine.disk.spill_all(pool, engine.prefix)

    # What the caller sees.

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def pending(self) -> int:
        """Requests waiting or running."""
        return self.scheduler.pending

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        return len(self.scheduler.batch)

    def busy_for(self) -> float:
        """Seconds the step loop has spent on its current turn (0 while idle): how a wedged step shows."""
        return 0.0 if self._busy_since is None else time.monotonic() - self._busy_since

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        n: int = 1,
        adapter: str | None = None,
    ) -> Sequence:
        """Queue a request; read ``seq.events`` until a ``Finish`` or a ``Failure``.

        With ``n`` > 1, ``seq.copies`` are the other n - 1 choices: the prompt is computed once, and they start
        from a copy of its cache, each sampled on its own (``Intake.sequences`` checks the request). ``adapter``:
        the LoRA adapter to generate with, by name (None: the base model).

        The caller must ``cancel`` each sequence when it stops reading (a ``finally``):
        a finished sequence ignores it, a queued one leaves the queue at once, and a
        running one is dropped at the next step boundary.
        """
        self._check_open()
        number = self.adapters.number(adapter)
        seqs = self.intake.sequences(prompt, params or SamplingParams(), request_id or uuid.uuid4().hex, n)
        for seq in seqs:
            seq.adapter = number
        self._queue(seqs[0])
        return seqs[0]

    def embed(self, prompts: list[list[int]], request_id: str) -> list[Sequence]:
        """Queue an embedding request, one sequence per input in order, as one request; read each one's events
        until its ``Finish`` (``embedding``: the vector) or a ``Failure``, and ``cancel`` each as ``submit`` says.
        Its inputs are fed in the steps that decode the running sequences, pooled on rank 0."""
        self._check_open()
        seqs = self.intake.embeddings(prompts, self.embedding.pooling, request_id)
        self._queue(seqs[0])
        return seqs

    def _check_open(self) -> None:
        if not self._accepting:
            raise Unavailable("the server is shutting down; retry on another instance")
        if self.pool.broken is not None and not self._resumes:
            raise Unavailable(f"{self.pool.broken}")
        if not self.health.ready and self._probe_failed:
            # Otherwise it queues: a failed step is followed at once by a probe, and one
            # step's failure should not turn away whoever arrives in the milliseconds it takes.
            raise Unavailable(f"not ready: {self.health.reason}", retry_after=math.ceil(REPROBE_S))

    def _queue(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self._idle = anyio.Event()
        self._wakeup.set()

    def cancel(self, seq: Sequence) -> None:
        if self.scheduler.cancel(seq):
            # Never started: it frees its place in the queue at once.
            self.output.cancelled(seq, 0)

    def abort(self, message: str) -> None:
        """Fail every queued and running request now (shutdown); the step in flight still completes."""
        self._accepting = False
        self._fail_all("unavailable", message)

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests, then wait up to ``timeout`` s for the queued and running ones; True if all ended."""
        self._accepting = False
        with anyio.move_on_after(timeout):
            while self.pending:
                await self._idle.wait()
            return True
        return False

    @property
    def _resumes(self) -> bool:
        """Whether a lost group pauses the batch (rather than failing it, and the leader restarting)."""
        return self.limits.resume_timeout > 0 and not self.lost.is_set()

    # The step loop: the only code that drives the pool.

    async def _loop(self) -> None:
        scheduler = self.scheduler
        while True:
            self._busy_since = time.monotonic()
            if self.pool.broken is not None and self._resumes:
                await self._recover()
                continue
            if not self.health.ready and self.pool.broken is None and not await self._probe():
                self._fail_all("unavailable", f"not ready: {self.health.reason}")
                self._busy_since = None
                self._probe_failed = True
                await anyio.sleep(REPROBE_S)
                self._probe_failed = False
                continue
            if self.disk is not None and self.prefix is not None and scheduler.waiting:
                await self.disk.reload(self.pool, self.prefix, scheduler.admissible())
            turn = scheduler.schedule()
            for seq, steps_after in turn.cancelled:
                self.output.cancelled(seq, steps_after)
            for seq in turn.admitted:
                if seq.paused is None:  # a paused sequence was started before, and resumes (``Output.resumed``)
                    self.output.started(seq)
            self.pressure.said(turn.preempted, turn.unfit)
            if turn.step is not None:
                await self._step(turn.step)
                continue
            if turn.clear:  # nothing left to run: one clear frees every rank's caches at once (prefixes stay)
                await self._clear_cache(prefixes=False)
            if not scheduler.waiting:
                self._idle.set()
                self._wakeup = anyio.Event()
                self._busy_since = None
                await self._wakeup.wait()

    async def _step(self, step: Step) -> None:
        started = time.perf_counter()
        plan = step.plan
        self._in_flight = step
        try:
            draft_steps = await _propose(self.pool, self.scheduler.running, plan)
            drafted = time.perf_counter()
            sampled = await self.pool.step(step)
            metrics.PREFILL_TOKENS.inc(plan.prefill_tokens)
        except PoolError as e:
            if e.out_of_memory and (self._resumes or not e.broken):
                # A rank failed to allocate anyway: the batch resumes within a lower budget (``Pressure.failed``),
                # on these ranks, their caches freed, or where peers may wait in a collective, on fresh ones.
                for seq, steps_after in self.pressure.failed(e):
                    self.output.cancelled(seq, steps_after)
                self._wakeup.set()
                if not e.broken:
                    with anyio.CancelScope(shield=True):
                        await self._clear_cache(prefixes=True)
                    return
            self._unready(e)
            if e.broken and self._resumes:
                if not e.out_of_memory:
                    self._pause(e, step)
                return
            # A lost group is a server that is about to restart (503, retry), not a failed request (500).
            self._fail_all("unavailable" if e.broken else "step_failed", str(e))
            with anyio.CancelScope(shield=True):
                await self._clear_cache(prefixes=True)
            return
        finally:
            self._in_flight = None
        ms = (time.perf_counter() - started) * 1000
        draft_ms = (drafted - started) * 1000
        self.pressure.follow()
        metrics.PREFIX_EVICTIONS.inc(len(plan.evict))
        if self.disk is not None:
            self.disk.written(step.spilled)
        cost = self.scheduler.cost
        cost.observe_draft(draft_steps, draft_ms)  # priced apart from the step's own time (``drafts.width``)
        deliveries = self.scheduler.update(step, sampled, ms - draft_ms)
        if self.scheduler.running:  # between requests it stays as the last batch left it
            self.pool.keep_loop_off_rank0(self.scheduler.steps_short)
        self.recent.add(ms / 1000, sum(1 for d in deliveries if d.kept))
        trace(
            log,
            "step",
            decode_rows=len(plan.decode),
            rows_fed=plan.rows_fed,
            prefill_tokens=plan.prefill_tokens,
            budget=step.budget,
            ms=round(ms, 2),
            draft_ms=round(draft_ms, 2),
            draft_step_ms=round(cost.draft_step_ms, 2),
            fixed_ms=round(cost.fixed_ms, 2),
            row_ms=round(cost.row_ms, 3),
            token_ms=None if cost.token_ms is None else round(cost.token_ms, 3),
            pair_ms=round(cost.pair_ms, 6),
        )
        for delivery in deliveries:
            self.output.deliver(delivery)

    def _fail_all(self, kind: str, message: str) -> None:
        for seq in self.scheduler.clear():
            self.output.failed(seq, kind, message)


def _caches(
    config: dict[str, Any], limits: Scheduling, pool: Pool, context: int
) -> tuple[Budget, PrefixIndex | None, PrefixDisk | None]:
    """What every rank's caches may hold (``engine.memory``: known once the calibration step has run, in ``open``,
    and followed as the steps read each rank's memory again), the prefix cache, and its disk tier.

    Each rank's share of a sequence's caches is ``Pool.cache_shares``; the query heads of a layer it computes, a
    slice of them under tensor parallelism, all of them in a pipeline stage. The prefix cache holds what the batch
    leaves of the budget, at most ``--prefix-cache-bytes`` (0: none).
    """
    heads = int(text_config(config).get("num_attention_heads") or 1)
    mine = heads if pool.layers else max(1, heads // pool.world_size)
    shares = [Share(per_token, per_sequence, mine) for per_token, per_sequence in pool.cache_shares]
    budget = Budget(shares, pool.hosts, max(1, min(limits.prefill_chunk, context - 1)), context)
    cap = limits.prefix_cache_bytes
    support = architectures.supports(config)
    # A sliding window's or a linear-attention state's cache is restored whole or not at all (rank.entries).
    exact = support is not None and not support.cuttable
    prefix = PrefixIndex(cap or 0, *pool.cache_bytes, exact=exact) if cap != 0 else None
    folder, cached = limits.prefix_cache_dir, prefix is not None
    disk = PrefixDisk.opened(folder, limits.prefix_cache_dir_bytes, cached, exact, pool.cache_bytes) if folder else None
    return budget, prefix, disk


async def _propose(pool: Pool, running: list[Sequence], plan: StepPlan) -> int:
    """Fill in the draft model's tokens (``DRAFTED`` in the plan: ``engine.drafts``), proposed on rank 0;
    returns how many it proposed one after another (the longest draft)."""
    wanted = [row for row in plan.decode if row.draft and row.draft[0] == DRAFTED]
    if not wanted:
        return 0
    by_no = {seq.no: seq for seq in running}
    rows = [
        DraftRow(row.seq, [*by_no[row.seq].prompt, *by_no[row.seq].output], len(row.draft), by_no[row.seq].params)
        for row in wanted
    ]
    proposed = await pool.draft(rows)
    for i, row in enumerate(plan.decode):
        if row.draft and row.draft[0] == DRAFTED:
            plan.decode[i] = dataclasses.replace(row, draft=proposed.get(row.seq, [])[: len(row.draft)])
    return max(len(row.draft) for row in wanted)


async def _draft_model(config: dict[str, Any], text: Text, limits: Scheduling, name: str) -> Path | None:
    """The draft model's folder (``--draft-model``, a Hub name fetched), its tokenizer checked to be the model's;
    None without one, or where this model speculates not at all. With ``--speculate mtp`` the model's own
    multi-token-prediction layers draft instead (rank/head/mtp.py), refused here, before anything loads, where they
    cannot; as is a ``--kv-bits`` the model's caches cannot take."""
    try:
        architectures.check_kv_bits(config, limits.kv_bits, KV_GROUP_SIZE)
    except architectures.Unsupported as e:
        raise ModelError(str(e)) from None
    heads = mtp_heads(config)
    if limits.speculate == "mtp":
        if limits.draft_model is not None:
            raise ModelError(
                f"--speculate mtp drafts with {name}'s own prediction layers and --draft-model with another model; "
                "pass one of them"
            )
        if problem := architectures.mtp_refusal(config, name):
            raise ModelError(f"--speculate mtp: {problem}")
        return None
    if heads:
        log.info(
            f"the model ships {heads} multi-token-prediction layer(s), which draft with --speculate mtp"
            + (": the draft model proposes instead" if limits.draft_model else "")
        )
    if limits.draft_model is None:
        return None
    if architectures.limits_for(config, limits)[0].speculate == "off":
        log.info("the draft model is not loaded: this server does not speculate", draft_model=limits.draft_model)
        return None
    path = await anyio.to_thread.run_sync(resolve, limits.draft_model)
    if heads := mtp_heads(read_config(path)):
        log.info(f"the draft model ships {heads} multi-token-prediction layer(s); neuron does not run them")
    if problem := text.differs(Text.load(path)):
        raise ModelError(
            f"--draft-model {limits.draft_model}: its tokenizer is not the model's ({problem}); pick a draft model "
            "of the same family, trained with the same tokenizer"
        )
    return path
