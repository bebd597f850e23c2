"""The engine: one task owns the pool and runs every step; requests share each step as a batch.

Why one task: the pool's ranks must see the same steps in the same order, so
exactly one caller may drive it. Requests never touch the pool; they queue a
``Sequence`` and read its events.

Each step is a plan (``rpc.StepPlan``): sequences that ended leave, waiting
prompts are fed in chunks (at most ``prefill_chunk`` tokens per step, so a long
prompt never stalls the running sequences for long), and every running
sequence decodes one token, all in one batched forward. Rank 0 samples each
sequence with its own parameters.

Why cancellation waits for the step boundary: a step handed to the workers
must finish on every rank (the pool shields it), or a rank is left inside a
collective. A caller that goes away only marks its sequence; the loop drops it
before the next step (it leaves in that step's plan); the others keep going.

Readiness: the engine is ready once a probe step has succeeded on every rank
since the last failure. A failed step (or a desync) fails the sequences in the
batch, clears every rank's cache, makes the engine unready (requests get 503),
and probes again at once, then every few seconds until a probe passes.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
from jinja2 import TemplateError
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, StreamingDetokenizer, TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from neuron import metrics
from neuron.engine.sequence import (
    Chunk,
    Failure,
    Finish,
    Overloaded,
    RequestError,
    Sequence,
    StopText,
    Unavailable,
)
from neuron.log import ms_since, progress, trace
from neuron.pool import Deadlines, Pool, PoolError
from neuron.rpc import StepPlan
from neuron.sampling_params import SamplingParams
from neuron.tp.model import ModelError, check_shardable
from neuron.tp.sampler import Sampled, Sampler, sample_all

log = structlog.get_logger("neuron.engine")

REPROBE_S = 5.0


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch: int = 8  # sequences decoding together; more wait in the queue
    max_waiting: int = 64  # requests queued beyond the batch; more get 429
    prefill_chunk: int = 512  # prompt tokens fed per step, across all prompts being fed
    max_context: int | None = None  # tokens per request (prompt + completion); None: the model's own


@dataclass(frozen=True, slots=True)
class Health:
    ready: bool
    reason: str  # why not ready, or "ready"


class Engine:
    def __init__(
        self,
        pool: Pool,
        tokenizer: TokenizerWrapper,
        model_path: Path,
        config: dict[str, Any],
        limits: Limits | None = None,
    ) -> None:
        text = config.get("text_config", config)
        self.pool = pool
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.limits = limits or Limits()
        model_context = int(text.get("max_position_embeddings") or 4096)
        self.context_length = min(model_context, self.limits.max_context or model_context)
        self.vocab_size = int(text["vocab_size"])
        self.health = Health(False, "not probed yet")
        # Set once the group is lost for good (a rank died or hung): only a fresh leader process can serve again.
        self.lost = anyio.Event()
        self.steps = 0  # steps run by this engine; cancellations are measured against it
        self._waiting: deque[Sequence] = deque()
        self._filling: list[Sequence] = []  # admitted, prompt being fed
        self._running: list[Sequence] = []  # decoding, in batch order
        self._leaving: list[int] = []  # sequences to drop in the next plan
        self._numbers = itertools.count(1)
        self._accepting = True
        self._wakeup = anyio.Event()
        self._idle = anyio.Event()
        self._busy_since: float | None = None  # when the loop's current pool call began; None while it waits
        self._probe_failed = False  # True while the loop waits to probe again
        metrics.WAITING.set_function(lambda: self.waiting)
        metrics.RUNNING.set_function(lambda: self.running)
        metrics.READY.set_function(lambda: float(self.health.ready))

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model_path: Path,
        world_size: int = 1,
        backend: str = "ring",
        deadlines: Deadlines | None = None,
        limits: Limits | None = None,
    ) -> AsyncIterator[Engine]:
        """Spawn the ranks, load the model, probe it, and run the step loop until the block exits."""
        # Refuse a model that cannot be split before a single worker is spawned.
        config = check_shardable(model_path, world_size)
        # Said out loud: a tokenizer_config.json's auto_map must never import a .py from the model folder.
        tokenizer = load_tokenizer(model_path, {"trust_remote_code": False})
        async with Pool(world_size, backend, deadlines) as pool:
            with progress(f"loading {model_path.name} on {world_size} rank(s)", 1) as advance:
                await pool.load(model_path)
                advance()
            engine = cls(pool, tokenizer, model_path, config, limits)
            if not await engine._probe():
                raise ModelError(f"the model loaded but its first step failed: {engine.health.reason}")
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine._loop)
                tg.start_soon(pool.watch, engine._on_lost)
                try:
                    yield engine
                finally:
                    engine.abort("the server is shutting down")
                    tg.cancel_scope.cancel()

    # What the caller sees.

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def pending(self) -> int:
        """Requests waiting or running."""
        return len(self._waiting) + len(self._filling) + len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._filling) + len(self._running)

    def busy_for(self) -> float:
        """Seconds the step loop has spent on its current turn (0 while idle): how a wedged step shows."""
        return 0.0 if self._busy_since is None else time.monotonic() - self._busy_since

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise RequestError(f"{self.model_path.name} has no chat template; use completions instead", "messages")
        try:
            tokens = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise RequestError(f"the model's chat template rejected the messages: {e}", "messages") from e
        return list(tokens)

    def submit(
        self,
        prompt: list[int],
        max_tokens: int | None = None,
        params: SamplingParams | None = None,
        stop: Seq[str] = (),
        request_id: str | None = None,
    ) -> Sequence:
        """Queue a request; read ``seq.events`` until a ``Finish`` or a ``Failure``.

        The caller must ``cancel(seq)`` when it stops reading (a ``finally``): a
        finished sequence ignores it, a queued one leaves the queue at once, and a
        running one is dropped at the next step boundary.
        """
        if not self._accepting:
            raise Unavailable("the server is shutting down; retry on another instance")
        if self.pool.broken is not None:
            raise Unavailable(f"{self.pool.broken}")
        if not self.health.ready and self._probe_failed:
            # Otherwise it queues: a failed step is followed at once by a probe, and one
            # step's failure should not turn away whoever arrives in the milliseconds it takes.
            raise Unavailable(f"not ready: {self.health.reason}", retry_after=math.ceil(REPROBE_S))
        if not prompt:
            raise RequestError("the prompt is empty: it needs at least one token", "prompt")
        if not all(0 <= t < self.vocab_size for t in prompt):
            raise RequestError(f"token ids must lie in [0, {self.vocab_size})", "prompt")
        if len(prompt) >= self.context_length:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.context_length}; shorten the prompt",
                "prompt",
                "context_length_exceeded",
            )
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        params = params or SamplingParams()
        if problems := params.problems(self.vocab_size):
            raise RequestError("; ".join(problems))
        if len(self._waiting) >= self.limits.max_waiting:
            raise Overloaded(f"{len(self._waiting)} requests are already waiting (the limit); retry shortly")
        budget = self.context_length - len(prompt)
        seq = Sequence(
            request_id or uuid.uuid4().hex,
            next(self._numbers),
            list(prompt),
            min(max_tokens, budget) if max_tokens is not None else budget,
            params,
            StopText(tuple(stop)),
        )
        seq.submitted = time.perf_counter()
        self._waiting.append(seq)
        self._idle = anyio.Event()
        self._wakeup.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        if seq.finished or seq.cancelled_at is not None:
            return
        seq.cancelled_at = self.steps
        if seq in self._waiting:
            # Never started: it frees its place in the queue at once.
            self._waiting.remove(seq)
            metrics.REQUESTS.labels("cancelled").inc()
            seq.emit(Finish("cancelled", len(seq.prompt), 0, ""))

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

    # The step loop: the only code that drives the pool.

    async def _loop(self) -> None:
        while True:
            self._busy_since = time.monotonic()
            if not self.health.ready and self.pool.broken is None and not await self._probe():
                self._fail_all("unavailable", f"not ready: {self.health.reason}")
                self._busy_since = None
                self._probe_failed = True
                await anyio.sleep(REPROBE_S)
                self._probe_failed = False
                continue
            self._drop_cancelled()
            self._admit()
            if not self._filling and not self._running:
                if self._leaving:
                    # Nothing left to run: one clear frees every rank's caches at once.
                    self._leaving.clear()
                    await self._clear_cache()
                if not self._waiting:
                    self._idle.set()
                    self._wakeup = anyio.Event()
                    self._busy_since = None
                    await self._wakeup.wait()
                continue
            await self._step()

    def _admit(self) -> None:
        while self._waiting and len(self._filling) + len(self._running) < self.limits.max_batch:
            seq = self._waiting.popleft()
            seq.sampler = Sampler(seq.params, seq.prompt)
            seq.detokenizer = self._detokenizer()
            seq.started = time.perf_counter()
            metrics.PROMPT_TOKENS.inc(len(seq.prompt))
            self._filling.append(seq)
            log.info(
                "request started",
                request_id=seq.id,
                prompt_tokens=len(seq.prompt),
                max_tokens=seq.max_tokens,
                temperature=seq.params.temperature,
                top_p=seq.params.top_p,
            )

    def _drop_cancelled(self) -> None:
        for seq in [s for s in (*self._filling, *self._running) if s.cancelled_at is not None]:
            self._remove(seq)
            if not seq.finished:
                log.info(
                    "request cancelled",
                    request_id=seq.id,
                    completion_tokens=seq.completion_tokens,
                    steps_after_cancel=self.steps - (seq.cancelled_at or 0),
                    ms=ms_since(seq.started),
                )
                metrics.REQUESTS.labels("cancelled").inc()
                seq.emit(Finish("cancelled", len(seq.prompt), seq.completion_tokens, ""))

    def _plan(self) -> StepPlan:
        budget = self.limits.prefill_chunk
        prefill = []
        for seq in self._filling:
            if budget <= 0:
                break
            take = min(budget, len(seq.prompt) - seq.fed)
            end = seq.fed + take
            prefill.append((seq.no, seq.fed, seq.prompt[seq.fed : end], end == len(seq.prompt)))
            budget -= take
        decode = [(seq.no, seq.next_token) for seq in self._running]
        return StepPlan(leave=list(self._leaving), prefill=prefill, decode=decode)  # type: ignore[arg-type]

    async def _step(self) -> None:
        plan = self._plan()
        samplers = {seq.no: seq.sampler for seq in (*self._filling, *self._running)}

        sample_s = 0.0

        def sample(logits: dict[int, Any]) -> dict[int, Sampled]:
            nonlocal sample_s
            started = time.perf_counter()
            out = sample_all(samplers, logits)
            sample_s = time.perf_counter() - started
            return out

        started = time.perf_counter()
        try:
            sampled = await self.pool.step(plan, sample)
        except PoolError as e:
            self._unready(e)
            # A lost group is a server that is about to restart (503, retry), not a failed request (500).
            self._fail_all("unavailable" if e.broken else "step_failed", str(e))
            with anyio.CancelScope(shield=True):
                await self._clear_cache()
            return
        self.steps += 1
        trace(
            log,
            "step",
            decode_rows=len(plan.decode),
            prefill_tokens=sum(len(t) for _, _, t, _ in plan.prefill),
            ms=ms_since(started),
            sample_ms=round(sample_s * 1000, 2),
        )
        self._leaving.clear()
        by_no = {seq.no: seq for seq in (*self._filling, *self._running)}
        # A sequence missing here was failed while the step ran (shutdown): nothing to deliver.
        for no, _, tokens, last in plan.prefill:
            if (seq := by_no.get(no)) is None:
                continue
            seq.fed += len(tokens)
            if last:
                self._filling.remove(seq)
                self._running.append(seq)
                log.info("prefill done", request_id=seq.id, prompt_tokens=len(seq.prompt), ms=ms_since(seq.started))
                self._take(seq, sampled[no])
        for no, _ in plan.decode:
            if (seq := by_no.get(no)) is not None:
                self._take(seq, sampled[no])

    def _take(self, seq: Sequence, sampled: Sampled) -> None:
        """One sampled token for ``seq``: emit its text, or finish it."""
        if sampled.token in self.tokenizer.eos_token_ids:
            self._finish(seq, "stop", stopped=False)
            return
        seq.completion_tokens += 1
        metrics.COMPLETION_TOKENS.inc()
        if seq.completion_tokens == 1:
            seq.first_token_at = time.perf_counter()
            metrics.TIME_TO_FIRST_TOKEN.observe(seq.first_token_at - seq.submitted)
        seq.detokenizer.add_token(sampled.token)
        text, stopped = seq.stop.push(seq.detokenizer.last_segment)
        seq.emit(Chunk(sampled.token, text, sampled.logprob, sampled.top))
        if stopped or seq.completion_tokens >= seq.max_tokens:
            self._finish(seq, "stop" if stopped else "length", stopped=stopped)
        else:
            seq.next_token = sampled.token

    def _finish(self, seq: Sequence, reason: str, *, stopped: bool) -> None:
        tail = ""
        if not stopped:
            # Release what the detokenizer (a partial character) and the stop check held back.
            seq.detokenizer.finalize()
            tail, stopped = seq.stop.push(seq.detokenizer.last_segment)
            if stopped:
                reason = "stop"
            else:
                tail += seq.stop.flush()
        self._remove(seq)
        if seq.first_token_at:
            log.info("decode done", request_id=seq.id, tokens=seq.completion_tokens, ms=ms_since(seq.first_token_at))
        log.info(
            "request done",
            request_id=seq.id,
            prompt_tokens=len(seq.prompt),
            completion_tokens=seq.completion_tokens,
            finish_reason=reason,
            ms=ms_since(seq.started),
        )
        metrics.REQUESTS.labels(reason).inc()
        if seq.completion_tokens > 1:
            decoding = time.perf_counter() - seq.first_token_at
            metrics.TIME_PER_OUTPUT_TOKEN.observe(decoding / (seq.completion_tokens - 1))
        seq.emit(Finish(reason, len(seq.prompt), seq.completion_tokens, tail))

    def _remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the batch; the ranks drop it in the next plan, if any of its prompt reached them."""
        for group in (self._filling, self._running):
            if seq in group:
                group.remove(seq)
                if seq.fed:
                    self._leaving.append(seq.no)

    def _fail_all(self, kind: str, message: str) -> None:
        for seq in (*self._waiting, *self._filling, *self._running):
            if not seq.finished:
                seq.cancelled_at = self.steps
                metrics.REQUESTS.labels("failed").inc()
                seq.emit(Failure(kind, message, len(seq.prompt), seq.completion_tokens))
        self._waiting.clear()
        self._filling.clear()
        self._running.clear()
        self._leaving.clear()

    def _detokenizer(self) -> StreamingDetokenizer:
        detokenizer = self.tokenizer.detokenizer
        if isinstance(detokenizer, BPEStreamingDetokenizer):
            # mlx-lm drops the first token's leading space; a completion continues its
            # prompt, so the text must be exactly what the tokens decode to.
            detokenizer._maybe_trim_space = lambda text: text  # type: ignore[method-assign]
        return detokenizer

    # Health.

    async def _clear_cache(self) -> None:
        if self.pool.broken is not None:
            return
        try:
            await self.pool.clear_kv_cache()
        except PoolError as e:
            self._unready(e)

    async def _probe(self) -> bool:
        """One token through every rank, from an empty cache and back to one."""
        try:
            await self.pool.clear_kv_cache()
            await self.pool.step(StepPlan(prefill=[(0, 0, [0], True)]), lambda _logits: None)
            await self.pool.clear_kv_cache()
        except PoolError as e:
            self._unready(e)
            return False
        if not self.health.ready:
            log.info("ready", world_size=self.pool.world_size)
        self.health = Health(True, "ready")
        return True

    def _unready(self, error: PoolError) -> None:
        self.health = Health(False, str(error))
        log.warning("not ready", reason=str(error), broken=error.broken)
        if error.broken:
            self.lost.set()

    def _on_lost(self, error: PoolError) -> None:
        """A worker exited: fail everything now, even between steps (a step in flight fails on its own)."""
        self._unready(error)
        self._fail_all("unavailable", str(error))
