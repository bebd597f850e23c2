"""``neuron.tracing``'s decisions: an unreachable collector is said at most once a minute, and a traced request
keeps the share of its steps ``--trace-step-ratio`` asks for (tests/e2e/platform/test_tracing.py exports to a
real receiver)."""

from __future__ import annotations

import logging
import random

import pytest

from neuron.tracing import EXPORT_WARNING_EVERY_S, RequestSpan, _Once


def test_a_failing_export_is_said_once_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("neuron.tracing.time.monotonic", lambda: now[0])
    once = _Once(EXPORT_WARNING_EVERY_S)
    record = logging.LogRecord("otel", logging.ERROR, __file__, 1, "Failed to export span batch", None, None)
    said = []
    for _ in range(30):  # a try every 5 s for 150 s
        said.append(once.filter(record))
        now[0] += 5
    assert said.count(True) == 3 and said[0] and said[12] and said[24]


def test_the_steps_kept_follow_the_ratio() -> None:
    random.seed(3)
    for ratio, low, high in ((0.0, 0, 0), (1.0, 1000, 1000), (0.05, 25, 80)):
        span = RequestSpan(span=None, tracer=None, step_ratio=ratio)
        for i in range(1000):
            span.stepped(float(i), {0: 0.01, 1: 0.012})
        assert low <= len(span.steps) <= high, (ratio, len(span.steps))


def test_a_span_closed_once_stays_as_it_ended() -> None:
    """A request refused after its first sequence was queued: ``refused`` ends the span, and the sequence's
    cancellation writes nothing more (nor the other way round)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracer = provider.get_tracer("test")
    refused_first = RequestSpan(tracer.start_span("text_completion tiny"), tracer, 0.0)
    refused_first.refused("the second prompt is too long")
    refused_first.end(1.0, 2.0, 0.0, 5, 0, 0, "cancelled")
    assert [span.name for span in exported.get_finished_spans()] == ["text_completion tiny"]
    exported.clear()
    ended_first = RequestSpan(tracer.start_span("chat tiny"), tracer, 0.0)
    ended_first.end(1.0, 2.0, 0.0, 5, 0, 0, "cancelled")
    ended_first.refused("too late")
    assert sorted(span.name for span in exported.get_finished_spans()) == ["chat tiny", "prefill", "queue"]
