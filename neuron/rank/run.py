"""One rank's whole part of a step, the same function on every rank: rank 0 additionally samples.

As nano-vllm's model runner does: every rank runs the step's forward (its
collectives must match), and only rank 0, which holds the logits, draws the
tokens. Then, where the plan allows, every rank queues the next decode step
(``rank.ahead``): rank 0 feeds it the tokens it has just drawn, still on the
device, and the others receive them through an all-reduce in the same graph.
Only after that does rank 0 read its tokens (the step's one wait on the
device), and every rank returns the digest of what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from neuron.rank import ahead
from neuron.rank.embed import as_sampled
from neuron.rank.head.head import Head
from neuron.rank.head.sampler import read
from neuron.rank.rank import Rank
from neuron.sampling_params import Sampled
from neuron.step import Step


@dataclass(frozen=True, slots=True)
class Stepped:
    """What a step left on one rank."""

    fingerprint: str  # the digest of the rank's state, which every worker's must match
    queued: bool  # whether the next step was run ahead
    sampled: dict[int, Sampled] = field(default_factory=dict)  # rank 0's draws, by sequence; empty elsewhere


def run(rank: Rank, step: Step, head: Head | None = None) -> Stepped:
    """Run ``step`` on ``rank``; with ``head`` (rank 0's), draw each sequence's tokens too. The most the step
    takes beyond what the rank holds before and after it raises ``rank.peak``."""
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    try:
        return _run(rank, step, head)
    finally:
        transient = mx.get_peak_memory() - max(before, mx.get_active_memory())
        rank.peak = max(rank.peak, transient)


def _run(rank: Rank, step: Step, head: Head | None) -> Stepped:
    logits = rank.step(step.plan, step.images) or {}
    if head is None:
        queued = rank.run_ahead(step.plan)  # queued or only built (``RunAhead.settle``), not waited for
        return Stepped(rank.held.fingerprint(), queued)
    draws, runs = head.draw(step, logits)
    if step.plan.ahead and ahead.EVALUATES_ASYNC:  # queued before the next step, so the read waits on them alone
        mx.async_eval([draw.arrays() for draw in draws.values()])
    queued = rank.run_ahead(step.plan, {no: draw.token for no, draw in draws.items() if draw.error is None})
    sampled = read(draws, runs)
    if rank.embedded:
        sampled |= as_sampled(rank.embedded)
    rank.ahead.fed({no: one.token for no, one in sampled.items()})
    return Stepped(rank.held.fingerprint(), queued, sampled)
