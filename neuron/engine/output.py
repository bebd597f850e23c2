"""What each request's reader gets: text chunks and a finish, rendered from the scheduler's deliveries, and the
request's logs and metrics along the way (started, prefill done, decode done, request done or cancelled).

Whether a token is output and whether its id or the sequence's length ends it is the scheduler's call
(``Scheduler.update``). The text is here, and so are stop strings: one found ends the sequence here (its reader
gets the text up to it and a finish), and the scheduler is told (``Scheduler.finish``), so that the sequence
leaves the batch at the next step boundary."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import structlog

from neuron import metrics
from neuron.engine.scheduler import Delivery
from neuron.engine.sequence import Chunk, Failure, Finish, Sequence
from neuron.log import ms_since
from neuron.step import Sampled

log = structlog.get_logger("neuron.engine")


class Detokenizer(Protocol):
    """Turns a sequence's tokens into text (``engine.text.Text``): what each releases, and whether a stop string
    ended it."""

    def start(self, seq: Sequence) -> None: ...

    def push(self, seq: Sequence, token: int, produced: int) -> tuple[str, bool]: ...

    def finish(self, seq: Sequence) -> tuple[str, bool]: ...


class Output:
    def __init__(self, text: Detokenizer, stopped: Callable[[Sequence, int], None], prefix_cache: bool = False) -> None:
        self.text = text
        self.stopped = stopped  # told when a stop string ends a sequence, after how many tokens (Scheduler.finish)
        self.prefix_cache = prefix_cache  # whether hits and misses are counted

    def started(self, seq: Sequence) -> None:
        """``seq`` was admitted to the batch."""
        seq.started = time.perf_counter()
        metrics.PROMPT_TOKENS.inc(len(seq.prompt))
        if seq.pooling is not None:  # one of up to thousands of inputs of one request: not a line each at info
            log.debug("embedding started", **seq.ids, prompt_tokens=len(seq.prompt))
            return
        self.text.start(seq)
        log.info(
            "request started",
            **seq.ids,
            prompt_tokens=len(seq.prompt),
            max_tokens=seq.max_tokens,
            temperature=seq.params.temperature,
            top_p=seq.params.top_p,
            waited_ms=ms_since(seq.submitted),  # in the queue: for a place in the batch, or for memory
        )

    def deliver(self, delivery: Delivery) -> None:
        """Render one token the scheduler delivered: its text, a stop string that ends it there, and the
        sequence's finish if it ended."""
        seq, sampled = delivery.seq, delivery.sampled
        if seq.finished:  # a stop string ended it earlier in this step's run of tokens
            return
        if seq.pooling is not None:
            self.embedded(seq, sampled)
            return
        if seq.paused is not None:
            self.resumed(seq)
        if delivery.first:
            log.info(
                "prefill done",
                **seq.ids,
                prompt_tokens=len(seq.prompt),
                cached_tokens=seq.cached,
                ms=ms_since(seq.started),
            )
            if self.prefix_cache:
                (metrics.PREFIX_HITS if seq.cached else metrics.PREFIX_MISSES).inc()
                metrics.PREFIX_CACHED_TOKENS.inc(seq.cached)
        if delivery.finish == "error":
            log.warning("constraint failed", **seq.ids, error=sampled.error)
            self.failed(seq, "constraint", sampled.error or "the output constraint failed")
            return
        reason = delivery.finish
        if delivery.kept:
            released, stopped = self.text.push(seq, sampled.token, delivery.produced)
            metrics.COMPLETION_TOKENS.inc()
            if not seq.first_token_at:
                seq.first_token_at = time.perf_counter()
                metrics.TIME_TO_FIRST_TOKEN.observe(seq.first_token_at - seq.submitted)
            seq.emit(Chunk(sampled.token, released, sampled.logprob, sampled.top))
            if stopped:
                self.stopped(seq, delivery.produced)
                self.finish(seq, "stop", "")
                return
        if reason is None:
            return
        tail = ""
        if seq.max_tokens > 0:  # the text held back, released now: a stop string may still close in it
            tail, stopped = self.text.finish(seq)
            if stopped and reason == "length":
                self.stopped(seq, delivery.produced)
                reason = "stop"
        self.finish(seq, reason, tail)

    def resumed(self, seq: Sequence) -> None:
        """``seq``'s first token since it was paused (the group lost under it, or preempted): its stream goes on."""
        assert seq.paused is not None
        replayed = len(seq.tokens)
        log.info(
            "resumed",
            **seq.ids,
            reason=seq.paused.reason,
            rank=seq.paused.rank,
            host=seq.paused.host,
            replayed_tokens=replayed,
            losses=seq.losses,
            ms=ms_since(seq.paused.at),
        )
        metrics.RESUMED.inc()
        metrics.REPLAYED_TOKENS.inc(replayed)
        if seq.trace is not None:
            seq.trace.resumed(seq.paused.reason, seq.paused.at)
        seq.paused = None

    def finish(self, seq: Sequence, reason: str, tail: str) -> None:
        """End ``seq`` with the text held back until now, and say why."""
        proposed, accepted = (seq.proposer.proposed, seq.proposer.accepted) if seq.proposer else (0, 0)
        if seq.first_token_at:
            log.info(
                "decode done",
                **seq.ids,
                tokens=seq.completion_tokens,
                ms=ms_since(seq.first_token_at),
                proposed_tokens=proposed,
                accepted_tokens=accepted,
            )
        metrics.SPECULATIVE_PROPOSED.inc(proposed)
        metrics.SPECULATIVE_ACCEPTED.inc(accepted)
        log.info(
            "request done",
            **seq.ids,
            prompt_tokens=len(seq.prompt),
            completion_tokens=seq.completion_tokens,
            finish_reason=reason,
            ms=ms_since(seq.started),
        )
        metrics.REQUESTS.labels(reason).inc()
        _used(seq, reason)
        if seq.completion_tokens > 1:
            decoding = time.perf_counter() - seq.first_token_at
            metrics.TIME_PER_OUTPUT_TOKEN.observe(decoding / (seq.completion_tokens - 1))
        rejected = proposed - accepted
        _end_trace(seq, reason)
        seq.emit(
            Finish(
                reason,
                len(seq.prompt),
                seq.completion_tokens,
                tail,
                seq.cached,
                _written(seq),
                accepted,
                rejected,
            )
        )

    def embedded(self, seq: Sequence, sampled: Sampled) -> None:
        """An embedding input's vector is ready: its one event."""
        log.debug("embedding done", **seq.ids, prompt_tokens=len(seq.prompt), ms=ms_since(seq.started))
        metrics.REQUESTS.labels("stop").inc()
        _used(seq, "stop")
        seq.emit(Finish("stop", len(seq.prompt), 0, "", embedding=sampled.embedding))

    def cancelled(self, seq: Sequence, steps_after_cancel: int) -> None:
        """The caller stopped listening: the sequence has left the batch (or never entered it)."""
        if seq.finished:
            return
        if seq.started:
            log.info(
                "request cancelled",
                **seq.ids,
                completion_tokens=seq.completion_tokens,
                steps_after_cancel=steps_after_cancel,
                ms=ms_since(seq.started),
            )
        if seq.proposer is not None:
            metrics.SPECULATIVE_PROPOSED.inc(seq.proposer.proposed)
            metrics.SPECULATIVE_ACCEPTED.inc(seq.proposer.accepted)
        metrics.REQUESTS.labels("cancelled").inc()
        _used(seq, "cancelled")
        _end_trace(seq, "cancelled")
        seq.emit(Finish("cancelled", len(seq.prompt), seq.completion_tokens, "", seq.cached, _written(seq)))

    def failed(self, seq: Sequence, kind: str, message: str) -> None:
        metrics.REQUESTS.labels("failed").inc()
        _used(seq, "failed")
        _end_trace(seq, "error")
        seq.emit(Failure(kind, message, len(seq.prompt), seq.completion_tokens))


def _used(seq: Sequence, outcome: str) -> None:
    """Count what ``seq`` used against its API key, where it came with one."""
    if seq.key is not None:
        metrics.KEY_REQUESTS.labels(seq.key, outcome).inc()
        metrics.KEY_PROMPT_TOKENS.labels(seq.key).inc(len(seq.prompt))
        metrics.KEY_COMPLETION_TOKENS.labels(seq.key).inc(seq.completion_tokens)


def _written(seq: Sequence) -> int:
    """The prompt tokens ``seq`` wrote to the prefix cache: its entry's, past those it restored (known only once
    the step that restored them came back, so counted here rather than when the entry is planned)."""
    return max(0, seq.cache_saved - seq.cached)


def _end_trace(seq: Sequence, reason: str) -> None:
    """Close ``seq``'s request span, if it has one, with its children (``tracing.RequestSpan.end``)."""
    if seq.trace is not None:
        trace, seq.trace = seq.trace, None
        trace.end(
            seq.submitted, seq.started, seq.first_token_at, len(seq.prompt), seq.cached, seq.completion_tokens, reason
        )
