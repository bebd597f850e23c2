"""The engine: one task owns the pool and runs every step; requests wait their turn.

Why one task: the pool's ranks must see the same steps in the same order, so
exactly one caller may drive it. Requests never touch the pool; they queue a
``Sequence`` and read its events. Requests run one at a time, each from an
empty KV cache.

Why cancellation waits for the step boundary: a step handed to the workers
must finish on every rank (the pool shields it), or a rank is left inside a
collective. A caller that goes away only marks its sequence; the loop drops it
before the next step, clears its KV cache and moves on. The request is not run
to its end.

Readiness: the engine is ready once a probe step has succeeded on every rank
since the last failure. A failed step makes it unready (requests get 503); it
probes again at once, then every few seconds until a probe passes.
"""

from __future__ import annotations

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
from neuron.log import progress
from neuron.pool import Deadlines, Pool, PoolError
from neuron.sampling_params import SamplingParams
from neuron.tp.model import ModelError, check_shardable
from neuron.tp.sampler import Sampler

log = structlog.get_logger("neuron.engine")

REPROBE_S = 5.0
DEFAULT_MAX_WAITING = 64


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
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> None:
        text = config.get("text_config", config)
        self.pool = pool
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.context_length = int(text.get("max_position_embeddings") or 4096)
        self.vocab_size = int(text["vocab_size"])
        self.max_waiting = max_waiting
        self.health = Health(False, "not probed yet")
        self.steps = 0  # steps run by this engine; cancellations are measured against it
        self._waiting: deque[Sequence] = deque()
        self._running: Sequence | None = None
        self._accepting = True
        self._wakeup = anyio.Event()
        self._idle = anyio.Event()

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model_path: Path,
        world_size: int = 1,
        backend: str = "ring",
        deadlines: Deadlines | None = None,
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> AsyncIterator[Engine]:
        """Spawn the ranks, load the model, probe it, and run the step loop until the block exits."""
        # Refuse a model that cannot be split before a single worker is spawned.
        config = check_shardable(model_path, world_size)
        tokenizer = load_tokenizer(model_path)
        async with Pool(world_size, backend, deadlines) as pool:
            with progress(f"loading {model_path.name} on {world_size} rank(s)", 1) as advance:
                await pool.load(model_path)
                advance()
            engine = cls(pool, tokenizer, model_path, config, max_waiting)
            if not await engine._probe():
                raise ModelError(f"the model loaded but its first step failed: {engine.health.reason}")
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine._loop)
                try:
                    yield engine
                finally:
                    engine.abort("the server is shutting down")
                    tg.cancel_scope.cancel()

    # What the caller sees.

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
        if not self.health.ready:
            raise Unavailable(f"not ready: {self.health.reason}")
        if not prompt:
            raise RequestError("the prompt is empty: it needs at least one token", "prompt")
        if not all(0 <= t < self.vocab_size for t in prompt):
            raise RequestError(f"token ids must lie in [0, {self.vocab_size})", "prompt")
        if len(prompt) >= self.context_length:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens but the model's context holds {self.context_length}; "
                "shorten the prompt",
                "prompt",
            )
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        params = params or SamplingParams()
        if problems := params.problems(self.vocab_size):
            raise RequestError("; ".join(problems))
        if len(self._waiting) >= self.max_waiting:
            raise Overloaded(f"{len(self._waiting)} requests are already waiting (the limit); retry shortly")
        budget = self.context_length - len(prompt)
        seq = Sequence(
            request_id or uuid.uuid4().hex,
            list(prompt),
            min(max_tokens, budget) if max_tokens is not None else budget,
            params,
            StopText(tuple(stop)),
        )
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
            self._finish(seq, "cancelled")

    def abort(self, message: str) -> None:
        """Fail every queued and running request now (shutdown); the step in flight still completes."""
        self._accepting = False
        for seq in [*self._waiting, *([self._running] if self._running else [])]:
            if not seq.finished:
                seq.cancelled_at = self.steps
                seq.emit(Failure("unavailable", message, len(seq.prompt), seq.completion_tokens))
        self._waiting.clear()

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def pending(self) -> int:
        """Requests waiting or running."""
        return len(self._waiting) + (self._running is not None)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests, then wait up to ``timeout`` s for the queued and running ones; True if all ended."""
        self._accepting = False
        with anyio.move_on_after(timeout):
            while self._waiting or self._running is not None:
                await self._idle.wait()
            return True
        return False

    # The step loop: the only code that drives the pool.

    async def _loop(self) -> None:
        while True:
            if not self.health.ready and self.pool.broken is None and not await self._probe():
                # Requests admitted before the failure would only wait for a probe that may never pass.
                for seq in self._waiting:
                    seq.emit(Failure("unavailable", f"not ready: {self.health.reason}", len(seq.prompt), 0))
                self._waiting.clear()
                await anyio.sleep(REPROBE_S)
                continue
            if not self._waiting:
                self._idle.set()
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                continue
            seq = self._waiting.popleft()
            self._running = seq
            try:
                await self._serve(seq)
            finally:
                self._running = None

    async def _serve(self, seq: Sequence) -> None:
        bound = log.bind(request_id=seq.id)
        if not self.health.ready:
            seq.emit(Failure("unavailable", f"not ready: {self.health.reason}", len(seq.prompt), 0))
            return
        started = time.perf_counter()
        sampler = Sampler(seq.params, seq.prompt)
        detokenizer = self._detokenizer()
        eos = self.tokenizer.eos_token_ids
        feed, offset, reason, tail, stopped = seq.prompt, 0, "length", "", False
        try:
            while seq.completion_tokens < seq.max_tokens:
                if seq.cancelled_at is not None:
                    reason = "cancelled"
                    break
                sampled = await self.pool.step(feed, offset, sampler)
                self.steps += 1
                offset += len(feed)
                if sampled.token in eos:
                    reason = "stop"
                    break
                seq.completion_tokens += 1
                detokenizer.add_token(sampled.token)
                text, stopped = seq.stop.push(detokenizer.last_segment)
                seq.emit(Chunk(sampled.token, text, sampled.logprob, sampled.top))
                if stopped:
                    reason = "stop"
                    break
                feed = [sampled.token]
            if reason != "cancelled" and not stopped:
                # Release what the detokenizer (a partial character) and the stop check held back.
                detokenizer.finalize()
                tail, stopped = seq.stop.push(detokenizer.last_segment)
                if stopped:
                    reason = "stop"
                else:
                    tail += seq.stop.flush()
        except PoolError as e:
            self._unready(e)
            bound.error("request failed", error=str(e), completion_tokens=seq.completion_tokens)
            seq.emit(Failure("step_failed", str(e), len(seq.prompt), seq.completion_tokens))
        finally:
            with anyio.CancelScope(shield=True):
                await self._clear_cache()
        if seq.finished:
            return
        ms = round((time.perf_counter() - started) * 1000, 1)
        if reason == "cancelled":
            assert seq.cancelled_at is not None
            bound.info(
                "request cancelled",
                completion_tokens=seq.completion_tokens,
                steps_after_cancel=self.steps - seq.cancelled_at,
                ms=ms,
            )
        else:
            bound.info(
                "request done",
                prompt_tokens=len(seq.prompt),
                completion_tokens=seq.completion_tokens,
                finish_reason=reason,
                ms=ms,
            )
        self._finish(seq, reason, tail)

    def _finish(self, seq: Sequence, reason: str, tail: str = "") -> None:
        seq.emit(Finish(reason, len(seq.prompt), seq.completion_tokens, tail))

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
            await self.pool.step([0], 0, lambda _logits: None)
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
