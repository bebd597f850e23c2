"""The engine: requests in, events out, over a pool of ranks running one model.

It is made of objects that each do one job: the scheduler decides each step (``engine.scheduler``, with its
admission by places and memory), the step loop drives the pool (``engine.loop``: the only code that does), the
recovery outlives a lost group (``engine.recovery``), the pressure follows the memory budget (``engine.pressure``),
and the output turns sampled tokens into each request's text and events (``engine.output``). The engine builds
them for one loaded model (``Engine.open``), and is the front door: ``submit``, ``embed``, ``cancel``, ``abort`` and
``drain``, checked by the intake (``engine.intake``) and queued for the loop.

A lost group (a rank died, hung, was cut off) fails nothing at first: the batch is paused, the pool replaces every
worker and rank 0's group in this process, and each paused sequence is fed its prompt and output so far again and
goes on; meanwhile new requests queue. Where the pool cannot recover in this process, or with ``resume_timeout``
0, every request fails and ``lost`` is set: the leader restarts its process.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import structlog

from neuron import metrics
from neuron.config.settings import KV_GROUP_SIZE
from neuron.engine.adapter_registry import Adapters
from neuron.engine.draining import Drains
from neuron.engine.intake import Intake
from neuron.engine.loop import REPROBE_S, Loop, Recent
from neuron.engine.memory import Budget, Share
from neuron.engine.output import Output
from neuron.engine.prefix import PrefixIndex
from neuron.engine.prefix_disk import PrefixDisk
from neuron.engine.pressure import Pressure
from neuron.engine.recovery import Health, Recovery
from neuron.engine.refusals import Overloaded, Unavailable
from neuron.engine.scheduler import Scheduler, Scheduling, ahead_for
from neuron.engine.sequence import Sequence
from neuron.engine.text import Text
from neuron.grammar import Grammars
from neuron.log import progress
from neuron.models import architectures
from neuron.models.architectures import mtp_heads
from neuron.models.folder import ModelError, embedding, read_config, resolve, text_config
from neuron.pool import Deadlines, Layout, Pool
from neuron.sampling_params import SamplingParams
from neuron.system import device
from neuron.tracing import RequestSpan

log = structlog.get_logger("neuron.engine")


class Engine:
    """Requests in, events out, for one loaded model; the step loop (``Loop``) drives its pool."""

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
        self.budget, self.prefix, self.disk = _caches(config, self.limits, pool, self.context_length)
        self.scheduler = Scheduler(self.limits, text.eos_token_ids, self.prefix, self.budget)
        self.scheduler.queues.spill = self.disk is not None
        self.output = Output(text, self.scheduler.queues.finish, self.prefix is not None)
        self.pressure = Pressure(pool, self.budget, self.scheduler, self.output, self.vocab_size, self.vision)
        self.recovery = Recovery(
            pool, self.scheduler, self.output, self.pressure, self._fail_all, self._wake, lambda: self._reshape(config)
        )
        self.drains = Drains(pool, self.recovery)  # the hosts the operator drains (neuron hosts drain)
        self.loop = Loop(
            pool, self.scheduler, self.output, self.recovery, self.pressure, self.disk, self._fail_all, self.drains
        )
        eos = frozenset(text.eos_token_ids)
        self.intake = Intake(self.limits, self.context_length, self.vocab_size, eos, text.tokenizer, self.budget)
        # The LoRA adapters served, by name; one that requests queued or running use stays.
        self.adapters = Adapters(pool, lambda: (*self.scheduler.waiting, *self.scheduler.batch))
        self._accepting = True
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
            # The first probe calibrates: what a step takes on each rank beyond its caches (``engine.memory``).
            if not await engine.recovery.probe(engine.budget.calibration_tokens):
                raise ModelError(f"the model loaded but its first step failed: {engine.health.reason}")
            await engine.pressure.read(calibrate=True)
            if engine.disk is not None and engine.prefix is not None:
                await engine.disk.restore(pool, engine.prefix)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(engine.loop.run)
                    tg.start_soon(pool.watch, engine.recovery.on_lost)
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
        return self.scheduler.queues.pending

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        return len(self.scheduler.batch)

    @property
    def health(self) -> Health:
        return self.recovery.health

    @property
    def lost(self) -> anyio.Event:
        """Set once the group is lost for good: only a fresh leader process can serve again."""
        return self.recovery.lost

    @property
    def recent(self) -> Recent:
        return self.loop.recent

    def busy_for(self) -> float:
        """Seconds the step loop has spent on its current turn (0 while idle): how a wedged step shows."""
        return self.loop.busy_for()

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        n: int = 1,
        adapter: str | None = None,
        priority: int = 0,
        trace: RequestSpan | None = None,
        key: str | None = None,
    ) -> Sequence:
        """Queue a request; read ``seq.events`` until a ``Finish`` or a ``Failure``.

        With ``n`` > 1, ``seq.copies`` are the other n - 1 choices: the prompt is computed once, and they start
        from a copy of its cache, each sampled on its own (``Intake.sequences`` checks the request). ``adapter``:
        the LoRA adapter to generate with, by name (None: the base model). ``priority``: where it waits under the
        priority policy (lower is sooner). ``trace``: its request's span (``neuron.tracing``), which the first
        sequence closes. ``key``: the name of the API key it came with (its fair share: ``engine.fairness``).

        The caller must ``cancel`` each sequence when it stops reading (a ``finally``):
        a finished sequence ignores it, a queued one leaves the queue at once, and a
        running one is dropped at the next step boundary.
        """
        self._check_open()
        number = self.adapters.number(adapter)
        seqs = self.intake.sequences(prompt, params or SamplingParams(), request_id or uuid.uuid4().hex, n)
        for seq in seqs:
            seq.adapter = number
            seq.priority = priority
            seq.key = key
            seq.trace_id = trace.trace_id if trace is not None else None
        self._check_images(seqs[0])
        seqs[0].trace = trace
        self._queue(seqs[0])
        return seqs[0]

    def embed(self, prompts: list[list[int]], request_id: str, key: str | None = None) -> list[Sequence]:
        """Queue an embedding request, one sequence per input in order, as one request; read each one's events
        until its ``Finish`` (``embedding``: the vector) or a ``Failure``, and ``cancel`` each as ``submit`` says.
        Its inputs are fed in the steps that decode the running sequences, pooled on rank 0."""
        self._check_open()
        seqs = self.intake.embeddings(prompts, self.embedding.pooling, request_id)
        for seq in seqs:
            seq.key = key
        self._queue(seqs[0])
        return seqs

    def _check_open(self) -> None:
        if not self._accepting:
            raise Unavailable("the server is shutting down; retry on another instance")
        if self.pool.broken is not None and not self.recovery.resumes:
            raise Unavailable(f"{self.pool.broken}")
        if not self.health.ready and self.loop.probe_failed:
            # Otherwise it queues: a failed step is followed at once by a probe, and one
            # step's failure should not turn away whoever arrives in the milliseconds it takes.
            raise Unavailable(f"not ready: {self.health.reason}", retry_after=math.ceil(REPROBE_S))

    def _check_images(self, seq: Sequence) -> None:
        """The images of the requests in flight stay within what the memory budget keeps for them on rank 0 (its
        encoder's inputs, held until the request ends): one more is refused for now."""
        if not seq.images:
            return
        flight = (*self.scheduler.waiting, *self.scheduler.batch)
        held = sum(image.inputs.nbytes for other in flight for image in other.images if image.inputs)
        more = sum(image.inputs.nbytes for image in seq.images if image.inputs)
        if held + more > self.budget.images:
            raise Overloaded(
                f"the images of the requests in flight hold {held >> 20} MiB of the {self.budget.images >> 20} MiB "
                "this server keeps for them; retry shortly"
            )

    def _queue(self, seq: Sequence) -> None:
        self.scheduler.queues.add(seq)
        self._wake()

    def _wake(self) -> None:
        self.loop.wake()

    def cancel(self, seq: Sequence) -> None:
        if self.scheduler.queues.cancel(seq):
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
                await self.loop.idle.wait()
            return True
        return False

    def _reshape(self, config: dict[str, Any]) -> None:
        """The group shrank and loaded the model again (``Recovery``): each rank's share of the caches is the smaller
        group's, and the prefix cache counts in its bytes; the calibration step that follows reads every rank."""
        self.budget.reshape(_shares(config, self.pool), self.pool.hosts)
        if self.prefix is not None:
            self.prefix.reshape(*self.pool.cache_bytes)

    def _fail_all(self, kind: str, message: str) -> None:
        for seq in self.scheduler.queues.clear():
            self.output.failed(seq, kind, message)


def _shares(config: dict[str, Any], pool: Pool) -> list[Share]:
    """Each rank's share of a sequence's caches (``Pool.cache_shares``), and the query heads of a layer it computes:
    a slice of them under tensor parallelism, all of them in a pipeline stage."""
    heads = int(text_config(config).get("num_attention_heads") or 1)
    mine = heads if pool.layers else max(1, heads // pool.world_size)
    return [Share(per_token, per_sequence, mine) for per_token, per_sequence in pool.cache_shares]


def _caches(
    config: dict[str, Any], limits: Scheduling, pool: Pool, context: int
) -> tuple[Budget, PrefixIndex | None, PrefixDisk | None]:
    """What every rank's caches may hold (``engine.memory``: known once the calibration step has run, in ``open``,
    and followed as the steps read each rank's memory again), the prefix cache, and its disk tier.

    Each rank's share is ``_shares``'. The prefix cache holds what the batch leaves of the budget, at most
    ``--prefix-cache-bytes`` (0: none).
    """
    chunk = max(1, min(limits.prefill_chunk, context - 1))
    budget = Budget(_shares(config, pool), pool.hosts, chunk, context, limits.memory_share)
    cap = limits.prefix_cache_bytes
    support = architectures.supports(config)
    # A sliding window's or a linear-attention state's cache is restored whole or not at all (rank.kv.entries).
    exact = support is not None and not support.cuttable
    prefix = PrefixIndex(cap or 0, *pool.cache_bytes, exact=exact) if cap != 0 else None
    folder, cached = limits.prefix_cache_dir, prefix is not None
    disk = PrefixDisk.opened(folder, limits.prefix_cache_dir_bytes, cached, exact, pool.cache_bytes) if folder else None
    return budget, prefix, disk


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
