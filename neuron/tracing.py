"""Requests traced with OpenTelemetry (``--otlp-traces-endpoint``, vLLM's flag), exported over OTLP/HTTP by
OpenTelemetry's own SDK and exporter. No MLX.

Why the SDK and not spans written by hand: its batching processor exports off the
step loop, on a thread of its own, and drops rather than blocks when the
collector is slow or gone; its propagator reads a client's W3C ``traceparent``;
and its exporter speaks the protocol every collector takes. It is imported only
where traces are asked for (``neuron[traces]``): off, nothing here runs.

A request's span opens when it is submitted (so its trace id is in its log
entries from the start) and its children are written when it ends, from the
times its sequences kept: queueing, prefill, decode, each pause (preemption or a
lost group) until it resumed, and, for a sampled share of its steps
(``--trace-step-ratio``), the step on each rank, as long as the leader waited
for that rank's reply, so that a slow rank shows. Attributes follow
OpenTelemetry's GenAI semantic conventions where they name the thing
(``gen_ai.*``); the rest are ``neuron.*``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger("neuron.server")

EXPORT_WARNING_EVERY_S = 60.0  # an unreachable collector is said at most this often
CLOSE_S = 2.0  # what a stopping server waits for its last spans to be exported


class TracingUnavailable(RuntimeError):
    """``--otlp-traces-endpoint`` was given, but OpenTelemetry's SDK is not installed."""


def _clock_offset() -> float:
    """Seconds to add to a ``perf_counter`` time to get Unix time (the sequences keep ``perf_counter`` times)."""
    return time.time() - time.perf_counter()


def _ns(perf: float, offset: float) -> int:
    return int((perf + offset) * 1e9)


class _Once:
    """A logging filter that lets one record through every ``every`` seconds: the exporter says a failed export each
    time it tries, every few seconds while a collector is down."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.last = -every

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self.last < self.every:
            return False
        self.last = now
        return True


@dataclass
class Step:
    at: float  # perf_counter time the step began
    ranks: dict[int, float]  # seconds each rank took (``pool.Timing.ranks``)


@dataclass
class RequestSpan:
    """One request's span, open from its submission; ``end`` writes its children and closes it."""

    span: Any
    tracer: Any
    step_ratio: float
    steps: list[Step] = field(default_factory=list)
    pauses: list[tuple[str, float, float]] = field(default_factory=list)  # reason, paused at, resumed at

    @property
    def trace_id(self) -> str:
        return f"{self.span.get_span_context().trace_id:032x}"

    def stepped(self, at: float, ranks: Mapping[int, float]) -> None:
        """A step this request took part in, begun at ``at``: kept for a sampled share of steps."""
        if random.random() < self.step_ratio:
            self.steps.append(Step(at, dict(ranks)))

    def resumed(self, reason: str, paused_at: float) -> None:
        self.pauses.append((reason, paused_at, time.perf_counter()))

    def refused(self, message: str) -> None:
        """The request never reached the engine (a 4xx, or a full queue): its span ends with the reason. A span its
        first sequence already closed (a later prompt of the request refused, the queued ones cancelled) stays as
        it ended."""
        from opentelemetry.trace import Status, StatusCode

        if not self.span.is_recording():
            return
        self.span.set_status(Status(StatusCode.ERROR, message))
        self.span.end()

    def end(
        self,
        submitted: float,
        started: float,
        first_token_at: float,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        finish_reason: str,
    ) -> None:
        """Write the children from the times the request kept (``perf_counter``), set the usage, and close."""
        from opentelemetry import trace

        if not self.span.is_recording():  # refused already (``refused``): nothing more to write
            return
        offset = _clock_offset()
        now = time.perf_counter()
        parent = trace.set_span_in_context(self.span)

        def child(name: str, start: float, end: float, **attributes: Any) -> Any:
            span = self.tracer.start_span(name, context=parent, start_time=_ns(start, offset), attributes=attributes)
            span.end(end_time=_ns(max(start, end), offset))
            return span

        admitted = started or now
        child("queue", submitted, admitted)
        first = first_token_at or now
        child(
            "prefill",
            admitted,
            first,
            **{"gen_ai.usage.input_tokens": prompt_tokens, "neuron.cached_tokens": cached_tokens},
        )
        if first_token_at:
            child(
                "decode",
                first,
                now,
                **{"gen_ai.usage.output_tokens": completion_tokens, "gen_ai.response.finish_reasons": [finish_reason]},
            )
        for reason, paused_at, resumed_at in self.pauses:
            child("paused", paused_at, resumed_at, **{"neuron.reason": reason})
        for step in self.steps:
            for rank, seconds in sorted(step.ranks.items()):
                child("step", step.at, step.at + seconds, **{"neuron.rank": rank})
        self.span.set_attributes(
            {
                "gen_ai.usage.input_tokens": prompt_tokens,
                "gen_ai.usage.output_tokens": completion_tokens,
                "gen_ai.response.finish_reasons": [finish_reason],
            }
        )
        self.span.end(end_time=_ns(now, offset))


class Tracing:
    """The tracer provider and its exporter, for the server's life."""

    def __init__(self, endpoint: str, step_ratio: float, service: str = "neuron") -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise TracingUnavailable(
                f"--otlp-traces-endpoint needs OpenTelemetry's SDK ({e.name} is missing): pip install 'neuron[traces]'"
            ) from e
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.exporter = OTLPSpanExporter(endpoint=endpoint)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = trace.get_tracer("neuron", tracer_provider=self.provider)
        self.step_ratio = step_ratio
        once = _Once(EXPORT_WARNING_EVERY_S)
        for name in ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.sdk.trace.export"):
            logging.getLogger(name).addFilter(once)
        log.info("tracing", endpoint=endpoint, step_ratio=step_ratio)

    def start(self, headers: Mapping[str, str], operation: str, model: str, params: Mapping[str, Any]) -> RequestSpan:
        """Open a request's span, continuing the client's ``traceparent`` where it sent one."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract(carrier=dict(headers))
        attributes = {"gen_ai.operation.name": operation, "gen_ai.request.model": model}
        attributes |= {f"gen_ai.request.{k}": v for k, v in params.items() if v is not None}
        span = self.tracer.start_span(f"{operation} {model}", context=context, attributes=attributes)
        return RequestSpan(span, self.tracer, self.step_ratio)

    def close(self) -> None:
        """Export what is left, for ``CLOSE_S`` at most: a collector out of reach must not hold a stopping server
        through the exporter's retries, so the exporter is shut then, which ends the retry under way (what is left
        is dropped). The SDK's own bounds do not do it: its flush ignores its timeout, its shutdown waits 30 s."""
        cutoff = threading.Timer(CLOSE_S, self.exporter.shutdown)
        cutoff.start()
        try:
            self.provider.shutdown()
        finally:
            cutoff.cancel()
