"""The step loop's own decisions, without a pool: how often a step reads every rank's memory."""

from __future__ import annotations

from neuron.engine.loop import MEMORY_EVERY_S, Every


def test_memory_is_read_on_the_first_step_then_at_most_every_few_seconds() -> None:
    now = [100.0]
    due = Every(MEMORY_EVERY_S, clock=lambda: now[0])
    assert due(), "the first step reads: the budget follows from the start"
    now[0] += MEMORY_EVERY_S - 0.1
    assert not due(), "a step sooner reads nothing, and its replies carry nothing"
    now[0] += 0.1
    assert due()
    assert not due(), "a step that said so counts as read"
