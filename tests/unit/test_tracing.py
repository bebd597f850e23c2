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
