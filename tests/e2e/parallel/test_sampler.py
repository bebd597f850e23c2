"""Rank 0's head follow the step they are given, and nothing beside it: no model, no process."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from neuron.rank.head.head import Head
from neuron.rank.head.sampler import Run, Sampler, read
from neuron.rpc import Decode, Prefill, StepPlan
from neuron.sampling_params import SamplingParams
from neuron.step import Start, Step


def test_a_sequence_the_step_neither_starts_nor_continues_is_refused() -> None:
    head = Head()
    with pytest.raises(KeyError, match=r"no sampler for sequences \[7\]"):
        head.step(Step(StepPlan(decode=[Decode(7, 1, 0)])), {7: mx.zeros(8)})
    with pytest.raises(KeyError, match=r"no sampler for sequences \[3\]"):
        head.step(Step(StepPlan(prefill=[Prefill(3, 0, [1, 2], True)])), {3: mx.zeros(8)})


def test_the_step_starts_each_sampler_with_its_own_parameters_and_the_tail_its_penalties_see() -> None:
    head = Head()
    logits = mx.array([0.0, 5.0, 4.9, 0.0])
    # Token 1 was in the restored prefix: a repetition penalty that sees it makes token 2 win.
    start = Start(SamplingParams(repetition_penalty=2.0), recent=(1,))
    step = Step(
        StepPlan(prefill=[Prefill(1, 3, [3], True), Prefill(2, 0, [3], True)]), {1: start, 2: Start(SamplingParams())}
    )
    out = head.step(step, {1: logits, 2: logits})
    assert (out[1].token, out[2].token) == (2, 1)
    follow = Step(StepPlan(leave=[2], decode=[Decode(1, 2, 0)]))
    assert set(head.step(follow, {1: logits})) == {1} and len(head) == 1


@pytest.mark.parametrize("mismatch_at", [0, 2, None])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_verifying_a_drawn_draft_reads_once_and_keeps_what_sampling_position_by_position_keeps(
    mismatch_at: int | None, temperature: float
) -> None:
    """A penalised request with logprobs (seeded, or greedy): the run kept, its logprobs and the sampler's state
    after it (the next draw) equal sampling the positions one by one. Every position has the same logits, so only
    the penalty on the tokens before it (the draft's, assumed kept) makes them differ, and ``min_tokens`` holds
    the favourite, a stop token, back for the first two."""
    params = SamplingParams(
        temperature=temperature, seed=11, repetition_penalty=3.0, logprobs=2, min_tokens=2, stop_token_ids=(5,)
    )
    row = mx.random.normal((16,), key=mx.random.key(3)) + mx.arange(16) * 0.2
    logits = mx.stack([mx.where(mx.arange(16) == 5, 9.0, row)] * 4)
    one_by_one = Sampler(params)
    expected = [one_by_one(logits[i]) for i in range(4)]
    assert len({s.token for s in expected}) > 1
    draft = [s.token for s in expected[:3]]
    if mismatch_at is not None:
        draft[mismatch_at] = (draft[mismatch_at] + 1) % 16
        # Position by position, the run stops at the first sampled token that differs from the draft.
        one_by_one = Sampler(params)
        expected = [one_by_one(logits[i]) for i in range(mismatch_at + 1)]
    verifying = Sampler(params)
    evaluations = 0
    original = mx.eval

    def counted(*args: object) -> None:
        nonlocal evaluations
        evaluations += 1
        original(*args)

    mx.eval = counted
    try:
        kept = read({}, {0: Run.draw(verifying, logits, draft)})[0]
        run = [dataclasses.replace(kept, more=()), *kept.more]
    finally:
        mx.eval = original
    assert evaluations == 1
    assert run == expected
    follow = mx.random.normal((16,), key=mx.random.key(4))
    assert verifying(follow) == one_by_one(follow)


def test_a_top_p_too_small_for_float32_keeps_the_most_likely_allowed_token() -> None:
    """top_p times the mass once rounded to zero in mlx-lm's float32 filter, which then dropped every token: the
    draw fell on token 0, outside the grammar's mask, and the request failed (schemathesis found it)."""
    logits = mx.array([3.0, 0.5, 2.0, 1.0, 0.0])
    allowed = mx.array([False, True, True, True, False])
    sampled = Sampler(SamplingParams(temperature=1.14, top_p=4e-95, seed=5))(logits, allowed)
    assert sampled.token == 2
