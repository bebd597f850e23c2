"""Rank 0's samplers follow the step they are given, and nothing beside it: no model, no process."""

from __future__ import annotations

import mlx.core as mx
import pytest

from neuron.rpc import Decode, Prefill, StepPlan
from neuron.sampling_params import SamplingParams
from neuron.step import Start, Step
from neuron.tp.sampler import Samplers


def test_a_sequence_the_step_neither_starts_nor_continues_is_refused() -> None:
    samplers = Samplers()
    with pytest.raises(KeyError, match=r"no sampler for sequences \[7\]"):
        samplers.step(Step(StepPlan(decode=[Decode(7, 1, 0)])), {7: mx.zeros(8)})
    with pytest.raises(KeyError, match=r"no sampler for sequences \[3\]"):
        samplers.step(Step(StepPlan(prefill=[Prefill(3, 0, [1, 2], True)])), {3: mx.zeros(8)})


def test_the_step_starts_each_sampler_with_its_own_parameters_and_the_tail_its_penalties_see() -> None:
    samplers = Samplers()
    logits = mx.array([0.0, 5.0, 4.9, 0.0])
    # Token 1 was in the restored prefix: a repetition penalty that sees it makes token 2 win.
    start = Start(SamplingParams(repetition_penalty=2.0), recent=(1,))
    step = Step(
        StepPlan(prefill=[Prefill(1, 3, [3], True), Prefill(2, 0, [3], True)]), {1: start, 2: Start(SamplingParams())}
    )
    out = samplers.step(step, {1: logits, 2: logits})
    assert (out[1].token, out[2].token) == (2, 1)
    follow = Step(StepPlan(leave=[2], decode=[Decode(1, 2, 0)]))
    assert set(samplers.step(follow, {1: logits})) == {1} and len(samplers) == 1
