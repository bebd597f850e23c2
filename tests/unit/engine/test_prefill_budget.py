"""How many prompt tokens a step feeds beside decoding streams (``scheduler.prefill_budget``), and the prompt-token
cost it is sized by (``StepCost.observe_prompt``): decisions only, no model, no process.

The end-to-end check, that streams' gaps stay within ``--itl-target-ms`` while a prompt of the whole context is
fed, is tests/e2e/serving/test_long_prompt.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from neuron.config.settings import MIN_PREFILL_CHUNK, Scheduling
from neuron.engine.drafts import MIN_SAMPLES, PROMPT_WINDOW, StepCost, attended
from neuron.engine.scheduler import Scheduler, prefill_budget
from neuron.rpc import ImageRun, StepPlan
from neuron.step import NOT_ASKED, Sampled
from testkit.scheduling import admitted, next_step, request, scheduler


def timed_decode(fixed_ms: float, row_ms: float) -> StepCost:
    """A step-time model whose decode line the engine has timed (one-row steps, as it happens)."""
    return StepCost(fixed_ms=fixed_ms, row_ms=row_ms, measured={1: fixed_ms + row_ms})


def measured(fixed_ms: float, row_ms: float, token_ms: float, pair_ms: float = 0.0, chunk: int = 1024) -> StepCost:
    """A step-time model as the engine's timings leave it: decode rows on a line, and prompt chunks of ``chunk``
    tokens fed one after another, a token at ``token_ms`` and each earlier token it attends to at ``pair_ms``."""
    cost = timed_decode(fixed_ms, row_ms)
    for position in range(0, chunk * MIN_SAMPLES, chunk):
        pairs = attended(position, chunk)
        cost.observe_prompt(chunk, pairs, 0, fixed_ms + chunk * token_ms + pairs * pair_ms)
    assert (cost.token_ms, cost.pair_ms) == (pytest.approx(token_ms), pytest.approx(pair_ms, abs=1e-12))
    return cost


def test_with_streams_decoding_the_chunk_fills_the_target_after_the_decode_rows() -> None:
    cost = measured(fixed_ms=40.0, row_ms=5.0, token_ms=2.0)
    limits = Scheduling(prefill_chunk=4096, itl_target_ms=200.0)
    assert prefill_budget(limits, cost, decoding=3) == (200 - 55) // 2  # 3 rows: 55 ms, 145 left at 2 ms a token
    assert prefill_budget(limits, cost, decoding=8) == (200 - 80) // 2  # more streams, less room for the prompt


def test_deeper_into_a_prompt_the_chunk_is_smaller() -> None:
    cost = measured(fixed_ms=40.0, row_ms=5.0, token_ms=0.5, pair_ms=0.001, chunk=64)
    limits = Scheduling(prefill_chunk=4096, itl_target_ms=200.0)
    shallow, deep = prefill_budget(limits, cost, 3, depth=0), prefill_budget(limits, cost, 3, depth=8000)
    assert deep < shallow <= 2 * 64  # no more than twice the largest chunk priced
    assert 0.5 * deep + attended(8000, deep) * 0.001 <= 145 < 0.5 * (deep + 1) + attended(8000, deep + 1) * 0.001


def test_no_stream_decoding_means_no_latency_to_protect_the_prompt_is_fed_at_the_cap() -> None:
    limits = Scheduling(prefill_chunk=4096, itl_target_ms=200.0)
    assert prefill_budget(limits, measured(40.0, 5.0, 2.0), decoding=0) == 4096
    assert prefill_budget(limits, StepCost(), decoding=0) == 4096  # cold too


def test_a_request_fed_beside_a_long_prompt_is_fed_whole_and_the_long_one_within_the_target() -> None:
    """No stream decodes, but a short prompt is fed beside a long one: the step that feeds it (and gives its first
    token) feeds it whole, and the long one only as far as the target leaves room, not at the cap."""
    limits = Scheduling(prefill_chunk=4096, itl_target_ms=200.0)
    cost = measured(40.0, 5.0, 2.0)
    assert prefill_budget(limits, cost, decoding=0, beside=4) == 4 + (200 - 40) // 2
    assert prefill_budget(limits, cost, decoding=0, beside=300) == 300 + 80  # a burst that came together: whole
    assert prefill_budget(limits, StepCost(), decoding=0, beside=4) == 4096  # cold: a burst at start goes whole


def test_the_scheduler_sizes_the_step_by_the_target_once_a_second_prompt_is_fed() -> None:
    s = scheduler(prefill_chunk=4096, itl_target_ms=200.0)
    s.cost = measured(40.0, 5.0, 2.0)
    admitted(s, request(6000))
    assert next_step(s).budget == 4096  # alone: the cap
    s.queues.add(request(4))
    assert next_step(s).budget == 4 + (200 - 40) // 2


def test_prefill_chunk_stays_the_hard_cap() -> None:
    cheap = measured(fixed_ms=5.0, row_ms=0.1, token_ms=0.01)  # an accelerator: 19000 tokens would fit
    assert prefill_budget(Scheduling(prefill_chunk=512, itl_target_ms=200.0), cheap, decoding=3) == 512
    free = measured(fixed_ms=5.0, row_ms=0.1, token_ms=0.0)  # a prompt token lost in the noise
    assert prefill_budget(Scheduling(prefill_chunk=512, itl_target_ms=200.0), free, decoding=3) == 512


def test_a_chunk_at_most_doubles_the_largest_one_priced() -> None:
    small = measured(fixed_ms=5.0, row_ms=0.1, token_ms=0.01, chunk=16)  # priced on 16-token chunks alone
    assert prefill_budget(Scheduling(prefill_chunk=512, itl_target_ms=200.0), small, decoding=3) == 32


def test_where_the_decode_rows_alone_fill_the_target_the_prompt_still_moves_at_the_floor() -> None:
    slow = measured(fixed_ms=250.0, row_ms=10.0, token_ms=40.0)  # a decode step alone takes 280 ms
    assert prefill_budget(Scheduling(prefill_chunk=512, itl_target_ms=200.0), slow, decoding=3) == MIN_PREFILL_CHUNK
    tight = measured(fixed_ms=150.0, row_ms=10.0, token_ms=40.0)  # 20 ms left: no whole token fits
    assert prefill_budget(Scheduling(prefill_chunk=512, itl_target_ms=200.0), tight, decoding=3) == MIN_PREFILL_CHUNK
    assert prefill_budget(Scheduling(prefill_chunk=8, itl_target_ms=200.0), slow, decoding=3) == 8  # the cap first


def test_cold_start_feeds_the_floor_until_a_prompt_token_is_priced() -> None:
    limits = Scheduling(prefill_chunk=4096, itl_target_ms=200.0)
    cost = timed_decode(40.0, 5.0)
    for _ in range(MIN_SAMPLES):
        assert prefill_budget(limits, cost, decoding=3) == MIN_PREFILL_CHUNK
        position = MIN_PREFILL_CHUNK * len(cost.prompt_steps)
        cost.observe_prompt(MIN_PREFILL_CHUNK, attended(position, MIN_PREFILL_CHUNK), 3, cost.ms(3) + 16 * 0.5)
    assert cost.token_ms == pytest.approx(0.5)
    assert prefill_budget(limits, cost, decoding=3) == 2 * MIN_PREFILL_CHUNK  # then doubling, as it is priced


def test_a_zero_target_turns_the_sizing_off() -> None:
    limits = Scheduling(prefill_chunk=4096, itl_target_ms=0.0)
    assert prefill_budget(limits, measured(40.0, 5.0, 40.0), decoding=3) == 4096
    assert prefill_budget(limits, StepCost(), decoding=3) == 4096


def test_before_any_decode_step_is_timed_the_whole_step_is_the_prompts() -> None:
    cost = StepCost()  # the prior's line: a decode step of 3 rows would take 63 ms, more than this machine's step
    for position in range(0, 16 * MIN_SAMPLES, 16):
        cost.observe_prompt(16, attended(position, 16), 3, 29.0)  # 5 ms of decode, 1.5 ms a token: a tiny model
    assert cost.token_ms == pytest.approx(29.0 / 16)  # high, not nothing (29 - 63 would say free)


def test_a_prompt_token_is_priced_at_what_the_step_took_beyond_its_decode_rows() -> None:
    cost = timed_decode(40.0, 5.0)
    cost.observe_prompt(10, 0.0, 3, 55.0 + 10 * 3.0)
    cost.observe_prompt(20, 0.0, 0, 40.0 + 20 * 3.0)  # no decode row: the fixed time only
    assert cost.token_ms is None  # not yet: a cold start
    cost.observe_prompt(10, 0.0, 3, 55.0 + 10 * 3.0)
    assert (cost.token_ms, cost.pair_ms) == (pytest.approx(3.0), 0.0)
    cost.observe_prompt(10, 0.0, 3, 1.0)  # faster than the line says: free, not negative
    assert min(y for _, _, y in cost.prompt_steps) == 0.0


def test_the_fit_follows_a_prompt_deeper_and_never_prices_below_nothing() -> None:
    cost = timed_decode(40.0, 5.0)
    for position in range(0, 64 * PROMPT_WINDOW, 64):  # 1 ms a token, and 0.01 ms a token attended to
        cost.observe_prompt(64, attended(position, 64), 3, 55.0 + 64 * 1.0 + attended(position, 64) * 0.01)
    assert (cost.token_ms, cost.pair_ms) == (pytest.approx(1.0), pytest.approx(0.01))
    for position in range(0, 64 * PROMPT_WINDOW, 64):  # deeper is cheaper: noise, a pair cannot cost less than 0
        cost.observe_prompt(64, attended(position, 64), 3, 55.0 + 64 * 1.0 - position * 0.01)
    assert cost.token_ms is not None and cost.token_ms > 0 and cost.pair_ms == 0.0


class Machine:
    """Times a step as a CPU does: a fixed part, a part per decode row, a part per prompt token, and a part per
    earlier token each prompt token attends to."""

    def __init__(self, fixed_ms: float, row_ms: float, token_ms: float, pair_ms: float = 0.0) -> None:
        self.fixed_ms, self.row_ms, self.token_ms, self.pair_ms = fixed_ms, row_ms, token_ms, pair_ms

    def ms(self, plan: StepPlan) -> float:
        pairs = sum(attended(chunk.position, len(chunk.tokens)) for chunk in plan.prefill)
        return self.fixed_ms + self.row_ms * plan.rows_fed + self.token_ms * plan.prefill_tokens + self.pair_ms * pairs


def run_timed(s: Scheduler, machine: Machine) -> tuple[StepPlan, int, float]:
    """One step planned and applied, timed by ``machine``: its plan, its budget and its time."""
    step = next_step(s)
    plan = step.plan
    having = [c.seq for c in plan.prefill if c.last] + [r.seq for r in plan.decode]
    ms = machine.ms(plan)
    s.update(step, {seq: Sampled(7, NOT_ASKED) for seq in having}, ms)
    return plan, step.budget, ms


@pytest.mark.parametrize("pair_ms", [0.0, 0.0005])
def test_a_long_prompt_beside_three_streams_keeps_every_step_within_the_target(pair_ms: float) -> None:
    machine = Machine(fixed_ms=40.0, row_ms=5.0, token_ms=1.0, pair_ms=pair_ms)
    s = scheduler(prefill_chunk=8192, itl_target_ms=200.0, max_batch=4)
    streams = [request(4, max_tokens=1000) for _ in range(3)]
    admitted(s, *streams)
    for _ in range(MIN_SAMPLES + 1):  # their prompts, alone: fed whole, then decode steps price the rows
        plan, budget, _ = run_timed(s, machine)
        assert budget == 8192 or plan.decode
    long = request(6000, max_tokens=1)
    admitted(s, long)
    cold, sized = [], []
    while long in s.filling:
        priced = s.cost.token_ms is not None
        plan, budget, ms = run_timed(s, machine)
        assert len(plan.decode) == 3 and plan.prefill_tokens == min(budget, len(long.prompt) - plan.prefill[0].position)
        (sized if priced else cold).append((budget, round(ms)))
    assert cold and all(budget == MIN_PREFILL_CHUNK for budget, _ in cold)  # until a prompt token is priced
    assert all(ms <= 200 for _, ms in sized), sized
    assert all(ms >= 190 for _, ms in sized[PROMPT_WINDOW:-1]), sized  # priced right: each step fills the target
    if pair_ms:  # deeper into the prompt, fewer tokens fill it
        assert sized[-2][0] < sized[PROMPT_WINDOW][0], sized


def test_a_chunk_with_an_image_does_not_price_a_prompt_token() -> None:
    s = scheduler(prefill_chunk=4)
    admitted(s, request(12))
    step = next_step(s)
    (chunk,) = step.plan.prefill
    with_image = replace(step.plan, prefill=[replace(chunk, images=[ImageRun(0, 4, "digest", 0)])])
    s.update(replace(step, plan=with_image), {}, 500.0)  # the encoder's time is no prompt token's
    assert list(s.cost.prompt_steps) == []
    s.update(next_step(s), {}, 500.0)
    assert list(s.cost.prompt_steps) == [(4, attended(4, 4), 500.0)]  # no decode step timed: the step's all


def test_a_prompt_not_yet_started_is_priced_as_fed_from_its_end() -> None:
    # It may restore a cached beginning of any length, found only as its plan is built: its first chunk errs small.
    s = scheduler(prefill_chunk=8192, itl_target_ms=200.0)
    stream = request(4, max_tokens=1000)
    admitted(s, stream)
    run_timed(s, Machine(fixed_ms=40.0, row_ms=5.0, token_ms=1.0))
    s.cost = measured(fixed_ms=40.0, row_ms=5.0, token_ms=0.5, pair_ms=0.001, chunk=64)
    long = request(6000, max_tokens=1)
    admitted(s, long)
    plan, budget, _ = run_timed(s, Machine(fixed_ms=40.0, row_ms=5.0, token_ms=0.5, pair_ms=0.001))
    assert plan.decode and budget == prefill_budget(s.limits, s.cost, 1, depth=6000)
    assert budget < prefill_budget(s.limits, s.cost, 1, depth=budget)  # once started, priced where it stands
