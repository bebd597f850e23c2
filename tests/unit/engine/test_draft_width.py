"""The batch's cost rule for drafts: which width a micro-batch is fed, and the step-time model it weighs.

No process, no model: the rule (``engine.drafts.width``), the cost model the engine fits (``StepCost``), each
sequence's acceptance estimate, and the scheduler's plans that apply them. Milliseconds each.
"""

from __future__ import annotations

import itertools
import random

import pytest

from neuron.engine.drafts import (
    COST_WINDOW,
    LOOKUP_PRIOR,
    MAX_K,
    MIN_SAMPLES,
    PREDICTION_PRIOR,
    PRIOR_FIXED_MS,
    PRIOR_ROW_MS,
    Proposer,
    StepCost,
    WindowMedians,
    expected_kept,
    width,
)
from neuron.engine.scheduler import Scheduler, Scheduling
from neuron.engine.sequence import Sequence, StopText
from neuron.sampling_params import SamplingParams
from neuron.step import NOT_ASKED, Sampled

CPU = StepCost()  # the prior: compute-bound, about 50 ms at batch 1 and 95 at batch 8
_numbers = itertools.count(1)


def test_expected_kept_tokens_are_geometric() -> None:
    assert expected_kept(0, 0.9) == 0
    assert expected_kept(3, 0.5) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_kept(8, 1.0) == 8


@pytest.mark.parametrize("acceptance", [0.0, 0.2, 0.4, 0.5])
def test_nothing_drafts_at_batch_8_when_acceptance_is_low(acceptance: float) -> None:
    assert width([(MAX_K, acceptance)] * 8, CPU) == 1


def test_drafts_survive_at_batch_1_where_extra_rows_are_nearly_free() -> None:
    assert width([(4, 0.5)], CPU) > 1
    free = StepCost(fixed_ms=50, row_ms=0.0)  # memory-bound: width costs nothing, every proposed token is fed
    assert width([(MAX_K, 0.1)], free) == 1 + MAX_K


def test_a_high_acceptance_row_keeps_its_draft() -> None:
    assert width([(MAX_K, 0.95)], CPU) == 1 + MAX_K
    assert width([(MAX_K, 0.95), (0, 0.0)], CPU) > MAX_K // 2  # it pays for its neighbour's padding too
    assert width([(MAX_K, 0.95)] * 8, CPU) > 2  # the whole batch keeps its drafts: worth widening at batch 8
    assert width([(MAX_K, 0.95)] + [(MAX_K, 0.1)] * 7, CPU) == 1  # but alone it does not pay for 7 rows' width


def test_no_draft_no_width() -> None:
    assert width([], CPU) == 1
    assert width([(0, 1.0)] * 4, CPU) == 1
    assert width([(2, 1.0)], StepCost(fixed_ms=50, row_ms=0.0)) == 3  # never wider than the longest draft


def test_the_width_grows_with_acceptance_and_shrinks_with_batch_and_row_cost() -> None:
    rates = [i / 20 for i in range(21)]
    by_rate = [width([(MAX_K, p)] * 4, CPU) for p in rates]
    assert by_rate == sorted(by_rate) and by_rate[0] == 1 and by_rate[-1] == 1 + MAX_K
    by_batch = [width([(MAX_K, 0.7)] * b, CPU) for b in range(1, 17)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[0] > 1 and by_batch[-1] == 1
    costs = [StepCost(fixed_ms=50, row_ms=r) for r in (0, 1, 2, 4, 8, 16, 32, 128)]
    by_cost = [width([(MAX_K, 0.7)] * 2, c) for c in costs]
    assert by_cost == sorted(by_cost, reverse=True) and by_cost[0] == 1 + MAX_K and by_cost[-1] == 1


def test_a_pipelines_micro_batch_pays_its_share_of_the_fixed_time() -> None:
    # Narrower fixed time per pass makes width relatively dearer.
    assert width([(MAX_K, 0.6)] * 2, CPU, share=0.5) < width([(MAX_K, 0.6)] * 2, CPU)


def test_the_cost_model_fits_the_steps_it_is_given() -> None:
    cost = StepCost()
    for rows in itertools.chain.from_iterable(itertools.repeat(range(1, 17), 4)):
        cost.observe(rows, 30 + 9 * rows + (2 if rows % 2 else -2))
    assert cost.fixed_ms == pytest.approx(30, abs=3) and cost.row_ms == pytest.approx(9, abs=0.5)


def test_the_cost_model_ignores_spikes_and_keeps_the_prior_ratio_without_spread() -> None:
    cost = StepCost()
    for i in range(40):
        cost.observe(8, 2000 if i % 10 == 0 else 190)  # a step now and then waits on another process
    assert cost.ms(8) == pytest.approx(190)  # the medians' scale
    assert cost.row_ms / cost.fixed_ms == pytest.approx(PRIOR_ROW_MS / PRIOR_FIXED_MS)  # one row count: no slope
    cost.observe(0, 10)
    cost.observe(3, -1)
    assert cost.ms(8) == pytest.approx(190)


def test_a_row_count_timed_enough_is_priced_at_its_own_median_not_the_line() -> None:
    """One row through sgemv (27 ms), two and more through sgemm (45 ms and up): a draft must pay for that jump."""
    cost = StepCost()
    for _ in range(3):
        cost.observe(1, 27.0)
        cost.observe(5, 50.0)
    row = [(4, 0.45)]  # a draft of 4, kept at 45% a token: 1.79 tokens expected at width 5
    assert cost.ms(1) == 27.0 and cost.ms(5) == 50.0
    assert width(row, cost) == 2  # the line through (1, 27) and (5, 50) prices two rows at 32.75 ms
    for _ in range(3):  # each width the line favours gets tried, and then priced as timed
        cost.observe(2, 45.0)
        cost.observe(3, 47.0)
        cost.observe(4, 48.5)
    assert width(row, cost) == 1  # timed, two rows cost 45 ms: 1.45 tokens in 45 ms lose to 1 in 27
    assert width([(4, 0.9)], cost) == 5  # a draft kept at 90% still pays for the jump
    assert cost.ms(5, share=0.5) == pytest.approx(0.5 * cost.fixed_ms + 5 * cost.row_ms)  # micro-batches: the line


def test_the_window_medians_kept_in_place_are_those_rebuilt_from_the_window() -> None:
    """Row counts that come, go and come back, times that tie: each step's medians, and their order, match a
    rebuild over the last ``COST_WINDOW`` steps."""
    rng = random.Random(7)
    window = WindowMedians(COST_WINDOW)
    steps: list[tuple[int, float]] = []
    for i in range(2000):
        counts = (1, 2) if i % 500 < 250 else (1, 2, 4, 8, 16)
        step = (rng.choice(counts), float(rng.randint(10, 30)))
        steps.append(step)
        rebuilt: dict[int, list[float]] = {}
        for r, t in steps[-COST_WINDOW:]:
            rebuilt.setdefault(r, []).append(t)
        want = [(r, sorted(ts)[len(ts) // 2], len(ts)) for r, ts in rebuilt.items() if len(ts) >= MIN_SAMPLES]
        assert window.add(*step) == want


def _sequence(prompt: list[int], max_tokens: int = 100) -> Sequence:
    no = next(_numbers)
    seq = Sequence(f"r{no}", no, prompt, max_tokens, SamplingParams(), StopText(()))
    seq.proposer = Proposer()
    return seq


def _step(s: Scheduler, token: int) -> list:
    step = s.schedule().step
    assert step is not None
    plan = step.plan
    having = [c.seq for c in plan.prefill if c.last] + [r.seq for r in plan.decode]
    s.update(step, {seq: Sampled(token, NOT_ASKED) for seq in having}, 1.0)
    return plan.decode


CYCLE = [5, 6, 7, 8] * 5  # prompt lookup drafts from it: after "7 8 5", "6 7 8 5"


def _batch(size: int, rate: float) -> tuple[Scheduler, list[Sequence]]:
    s = Scheduler(Scheduling(max_batch=8), {2})
    seqs = [_sequence(list(CYCLE)) for _ in range(size)]
    for seq in seqs:
        assert seq.proposer is not None
        seq.proposer.lookup_rate = rate
        s.queues.add(seq)
    _step(s, 5)  # the prompts: each samples 5, and the lookup finds the cycle
    return s, seqs


def test_the_plan_cuts_every_draft_at_batch_8_and_keeps_it_at_batch_1() -> None:
    s, _ = _batch(8, 0.3)
    assert all(row.draft == [] for row in _step(s, 6))
    s, _ = _batch(1, LOOKUP_PRIOR)
    assert _step(s, 6)[0].draft[:2] == [6, 7]  # cut short of all 4 at a coin's acceptance, not to nothing
    s, _ = _batch(8, 0.95)
    rows = _step(s, 6)
    assert len({len(row.draft) for row in rows}) == 1 and rows[0].draft  # one width, wider than 1


def test_a_draft_cut_whole_is_no_miss_and_the_output_still_scores_it() -> None:
    s, seqs = _batch(8, 0.3)
    proposer = seqs[0].proposer
    assert proposer is not None
    k = proposer.k
    for _ in range(10):  # each step's withheld draft is right: the sampled tokens follow the cycle
        rows = _step(s, CYCLE[len(seqs[0].output) % 4])
        if rows[0].draft:
            break
        assert (proposer.k, proposer.misses, proposer.resting, proposer.proposed) == (k, 0, 0, 0)
    assert proposer.lookup_rate > 0.5  # learned from the output alone, and now worth widening for
    assert rows[0].draft


def test_the_estimate_follows_verified_tokens_and_a_matching_prediction_starts_high() -> None:
    chat = Proposer()
    assert chat.acceptance == LOOKUP_PRIOR
    chat.update(4, 4)
    assert chat.lookup_rate > LOOKUP_PRIOR
    before = chat.lookup_rate
    chat.update(4, 1)  # one kept, one rejected; the two after it were never compared
    assert chat.lookup_rate == pytest.approx(before + 0.1 * (1 - before) - 0.1 * (before + 0.1 * (1 - before)))
    predicted = Proposer(prediction=[5, 6, 7, 8])
    assert predicted.propose([1], [5], room=10) == [6, 7, 8]
    assert predicted.acceptance == PREDICTION_PRIOR


def test_a_draft_models_own_steps_are_priced_so_a_slow_or_useless_one_drafts_nothing() -> None:
    """Each draft token a model proposes is one of its steps before the target's: a width of W costs W - 1 of
    them. A free draft at the floor's acceptance may still be tried at batch 1 (a width costs little there); one
    whose step costs a tenth of the target's is not, and a good draft pays for even a slow one's steps."""
    gpu = StepCost(fixed_ms=50.0, row_ms=0.5)  # wide rows nearly free: only the draft's own steps can cost
    assert width([(MAX_K, 0.1)], gpu, modelled=MAX_K) > 1  # not timed yet: drafted
    gpu.observe_draft(4, 20.0)  # 5 ms a draft token, a tenth of a step
    assert gpu.draft_step_ms == 0.0  # one draft timed: its first, which fed the draft its prompt, may mislead
    gpu.observe_draft(4, 20.0)
    gpu.observe_draft(4, 400.0)  # a draft that caught up on a long prompt: the median ignores it
    assert gpu.draft_step_ms == 5.0
    assert width([(MAX_K, 0.1)], gpu, modelled=MAX_K) == 1
    assert width([(MAX_K, 0.1)], gpu) > 1  # the same drafts from prompt lookup cost no steps of their own
    assert width([(MAX_K, 0.9)], gpu, modelled=MAX_K) == 1 + MAX_K
    slow = StepCost(fixed_ms=50.0, row_ms=0.5, draft_step_ms=25.0)  # half a target step a draft token
    assert width([(MAX_K, 0.5)], slow, modelled=MAX_K) == 1
    assert width([(MAX_K, 0.95)], slow, modelled=MAX_K) > 1
