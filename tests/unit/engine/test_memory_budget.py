"""The memory budget's decisions, checked directly: what each rank's reading leaves the caches, which rank rules,
who is admitted, who is preempted and in which order, what the prefix cache gives way, what a request that could
never fit is told. No process, no model; milliseconds each (the end-to-end proof:
tests/e2e/memory/test_memory_limit.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from neuron.engine import memory
from neuron.engine.intake import Intake
from neuron.engine.memory import HEADROOM_MIN, RESERVE, STEP, Budget, Share, rank_budget
from neuron.engine.prefix import PrefixIndex
from neuron.engine.refusals import RequestError
from neuron.engine.scheduler import Scheduler, Scheduling, Turn
from neuron.engine.sequence import Sequence, Status, StopText
from neuron.rpc import Memory
from neuron.sampling_params import SamplingParams
from neuron.step import Sampled

MIB = 1 << 20
PER_TOKEN = 1000  # bytes of keys and values per token on the reference rank
EOS = 2
_numbers = itertools.count(1)


def reading(free: int, caches: int = 0, peak: int = 0, total: int = 0) -> Memory:
    return Memory(used=0, free=free, at=0.0, total=total, caches=caches, peak=peak)


def holding(tokens: int, ranks: int = 1, per_token: int = PER_TOKEN) -> Budget:
    """A budget whose caches may hold exactly ``tokens`` tokens' keys and values on each of ``ranks`` ranks."""
    budget = Budget([Share(per_token, 0, 0)] * ranks, ["here"] * ranks, chunk=16, context=100_000)
    budget.read({rank: reading(tokens * per_token + HEADROOM_MIN) for rank in range(ranks)})
    assert budget.bytes == tokens * per_token
    return budget


def request(prompt_tokens: int, max_tokens: int = 1000) -> Sequence:
    no = next(_numbers)
    prompt = [100 + no % 100] + [10 + i % 50 for i in range(prompt_tokens - 1)]  # no two share a beginning
    return Sequence(f"r{no}", no, prompt, max_tokens, SamplingParams(temperature=0.0), StopText(()))


def scheduler(budget: Budget, prefix: PrefixIndex | None = None, **limits: object) -> Scheduler:
    return Scheduler(Scheduling(**limits), {EOS}, prefix, budget)  # type: ignore[arg-type]


def apply(s: Scheduler, turn: Turn) -> None:
    """Run ``turn``'s step as every rank would: token 7 sampled for every sequence that has logits."""
    if turn.step is None:
        return
    plan = turn.step.plan
    ended = [c.seq for c in plan.prefill if c.last] + [row.seq for row in plan.decode]
    s.update(turn.step, {no: Sampled(7, -0.1) for no in ended}, 10.0)


def run(s: Scheduler, steps: int = 1) -> list[Sequence]:
    """``steps`` turns; the sequences preempted."""
    preempted = []
    for _ in range(steps):
        turn = s.schedule()
        preempted += turn.preempted
        apply(s, turn)
    return preempted


def until(s: Scheduler, happens: Callable[[Turn], bool], most: int = 2000) -> Turn:
    """Turns until one for which ``happens`` holds: that one, not yet run."""
    for _ in range(most):
        turn = s.schedule()
        if happens(turn):
            return turn
        apply(s, turn)
    raise AssertionError(f"it did not happen in {most} turns")


def test_a_ranks_caches_get_its_room_and_what_they_hold_less_a_step_and_the_headroom() -> None:
    share = Share(per_token=1000, per_sequence=0, heads=2)
    gib = 1 << 30
    got = rank_budget(
        0, "here", reading(free=2 * gib, caches=gib, peak=10 * MIB, total=8 * gib), share, 40 * MIB, 64, 4096
    )
    headroom = int(8 * gib * memory.HEADROOM_SHARE)
    scores = 64 * 2 * memory.SCORE_BYTES  # a chunk's attention scores per token of context
    assert got.headroom == headroom
    # The steps' reserve: the calibration step and a chunk's scores at the longest context, the model's here.
    assert got.longest == 4096 and got.steps == 40 * MIB + 4096 * scores
    assert got.budget == 3 * gib - headroom - got.steps
    # A step measured larger than that is what is kept free.
    assert rank_budget(0, "h", reading(2 * gib, gib, gib, 8 * gib), share, 40 * MIB, 64, 4096).steps == gib
    # A small host: the longest sequence is what its caches and the scores at its end hold, not the model's context.
    small = rank_budget(0, "h", reading(free=200 * MIB, total=gib), share, 40 * MIB, 64, 1_000_000)
    assert small.longest < 1_000_000
    assert small.longest * (share.per_token + scores) <= 200 * MIB - HEADROOM_MIN - 40 * MIB
    assert (small.longest + STEP) * share.per_token <= small.budget


def test_servers_that_share_a_host_each_budget_their_part_and_together_no_more_than_there_is() -> None:
    """``--memory-share``: a router's models on one host. Each reads the same free memory, its own caches beside
    it; each part is taken of both, so that the budgets add up to no more than the host holds for caches."""
    share = Share(per_token=1000, per_sequence=0, heads=2)
    gib = 1 << 30
    whole = rank_budget(0, "h", reading(free=4 * gib, caches=gib, total=8 * gib), share, 40 * MIB, 64, 4096)
    half = rank_budget(0, "h", reading(free=4 * gib, caches=gib, total=8 * gib), share, 40 * MIB, 64, 4096, part=0.5)
    assert half.budget == int(5 * gib * 0.5) - half.headroom - half.steps
    other = rank_budget(0, "h", reading(free=4 * gib, caches=0, total=8 * gib), share, 40 * MIB, 64, 4096, part=0.5)
    assert half.budget + other.budget <= 5 * gib and whole.budget > half.budget


def test_the_smallest_rank_rules_tensor_parallelism_and_each_stage_its_layers() -> None:
    tp = Budget([Share(1000, 0, 0)] * 2, ["a", "b"], 16, 100_000)
    tp.read({0: reading(900 * MIB), 1: reading(300 * MIB)})
    assert tp.where() == (1, "b") and tp.bytes == 300 * MIB - HEADROOM_MIN
    # Pipeline stages of 3 and 1 layers: the first holds three times the bytes per token, so it rules with three
    # times the memory of the second; the budget is counted in the larger share's bytes.
    pp = Budget([Share(3000, 0, 0), Share(1000, 0, 0)], ["a", "b"], 16, 100_000)
    pp.read({0: reading(3 * 100 * MIB + HEADROOM_MIN), 1: reading(50 * MIB + HEADROOM_MIN)})
    assert pp.where() == (1, "b") and pp.bytes == 3 * 50 * MIB
    pp.read({0: reading(3 * 40 * MIB + HEADROOM_MIN), 1: reading(50 * MIB + HEADROOM_MIN)})
    assert pp.where() == (0, "a") and pp.bytes == 3 * 40 * MIB
    # Until every rank has been read, the last full reading stands.
    pp.read({0: reading(0)})
    assert pp.bytes == 3 * 40 * MIB


def test_the_batch_holds_each_micro_batch_padded_to_its_longest_row_and_a_growth_step() -> None:
    budget = holding(10_000)
    assert budget.usage([[100, 300], [50]]) == (2 * (300 + STEP) + (50 + STEP)) * PER_TOKEN
    seq = request(100, max_tokens=1000)
    assert memory.reservation(seq) == 100 + RESERVE
    assert memory.reservation(request(100, max_tokens=10)) == 110  # room for what it may still produce, no more


def test_requests_are_admitted_while_their_reservations_fit_first_come_first_served() -> None:
    # Room for three rows of 100 prompt tokens and their reserve, padded and with a growth step each: not four.
    row = 100 + RESERVE + STEP
    s = scheduler(holding(3 * row + row // 2))
    seqs = [request(100) for _ in range(4)] + [request(10)]
    for seq in seqs:
        s.queues.add(seq)
    assert s.schedule().admitted == seqs[:3]
    # The fourth waits for memory, and the short one behind it waits too: none passes a request that waits.
    assert list(s.waiting) == seqs[3:]


def test_the_newest_sequence_is_preempted_as_the_batch_outgrows_the_budget_and_resumes_first() -> None:
    row = 100 + RESERVE + STEP
    budget = holding(2 * row + 40)  # two rows as admitted, and 20 tokens of growth each past their reservation
    s = scheduler(budget)
    first, second, third = request(100), request(100), request(100)
    for seq in (first, second, third):
        s.queues.add(seq)
    assert run(s) == []
    assert s.running == [first, second] and list(s.waiting) == [third]
    # Past its reservation each row grows (its token and a draft's room each step): the newest is paused first.
    preempted = run(s, RESERVE + 30)
    assert preempted[0] is second
    assert second.paused is not None and second.paused.reason == "memory"
    assert second.replay == [*second.prompt, *second.output] and second.status in (Status.WAITING, Status.FILLING)
    # It went back ahead of the request that never started, to resume before it.
    assert second in s.batch or s.waiting[0] is second
    assert third.status is Status.WAITING


def test_a_preempted_sequence_leaves_every_rank_and_is_fed_its_prompt_and_output_again() -> None:
    row = 100 + RESERVE + STEP
    s = scheduler(holding(2 * row + 40))
    first, second = request(100), request(100)
    for seq in (first, second):
        s.queues.add(seq)
    turn = until(s, lambda turn: bool(turn.preempted))
    assert turn.preempted == [second] and turn.step is not None and second.no in turn.step.plan.leave
    assert [row.seq for row in turn.step.plan.decode] == [first.no]
    produced = tuple(second.output)
    apply(s, turn)
    # Once the first ends, the second is admitted again: its prompt and output so far fed as one prompt, its
    # sampler told what it had produced (so that a seeded stream goes on as it would have).
    s.queues.cancel(first)
    turn = until(s, lambda turn: turn.step is not None and any(c.seq == second.no for c in turn.step.plan.prefill))
    assert turn.step is not None
    chunk = next(c for c in turn.step.plan.prefill if c.seq == second.no)
    assert chunk.position == 0 and chunk.tokens == [*second.prompt, *produced][: len(chunk.tokens)]
    assert turn.step.starts[second.no].produced == produced


def test_the_prefix_cache_gives_way_before_any_sequence_is_preempted() -> None:
    rows = 2 * (120 + RESERVE + STEP)  # two rows padded to the longer one's reservation
    prefix = PrefixIndex(10**12, PER_TOKEN)
    s = scheduler(holding(rows + 50), prefix)
    s.queues.add(request(100))
    run(s, 1)
    # The prompt was saved as an entry, in what the batch leaves of the budget.
    left = rows + 50 - (100 + RESERVE + STEP)
    assert prefix.bytes == 100 * PER_TOKEN and prefix.budget == left * PER_TOKEN
    # A second request's reservation takes what the entry held: the entry is evicted, nobody is preempted.
    s.queues.add(request(120))
    turn = s.schedule()
    assert len(turn.admitted) == 1 and turn.preempted == []
    assert prefix.bytes == 0 and prefix.budget == 50 * PER_TOKEN
    apply(s, turn)
    turn = s.schedule()  # the eviction goes in the next plan, after the lookups of the one that admitted
    assert turn.step is not None and len(turn.step.plan.evict) == 1


def test_a_preempted_sequence_goes_to_the_disk_tier_where_one_is_set() -> None:
    row = 100 + RESERVE + STEP
    s = scheduler(holding(2 * row + 40), PrefixIndex(0, PER_TOKEN))
    s.queues.spill = True
    first, second = request(100), request(100)
    for seq in (first, second):
        s.queues.add(seq)
    turn = until(s, lambda turn: bool(turn.preempted))
    assert turn.step is not None
    plan = turn.step.plan
    (save,) = [save for save in plan.save if save.seq == second.no]
    (evict,) = [evict for evict in plan.evict if evict.entry == save.entry]
    held = [*second.prompt, *second.output]
    assert evict.key and turn.step.spilled[evict.key] == held[: save.tokens] and save.tokens > len(second.prompt)


def test_one_sequence_alone_that_no_longer_fits_ends_with_an_error() -> None:
    budget = holding(100 + RESERVE + STEP)
    s = scheduler(budget)
    s.queues.add(request(100))
    run(s, 1)
    budget.read({0: reading(50 * PER_TOKEN + HEADROOM_MIN)})  # another process took the host's memory
    turn = s.schedule()
    assert len(turn.unfit) == 1 and turn.unfit[0].status is Status.FINISHED_ERROR
    assert turn.preempted == []


def test_a_request_that_could_never_fit_is_refused_with_its_prompt_and_the_budget() -> None:
    budget = holding(1000 + STEP, per_token=MIB)
    intake = Intake(Scheduling(), 100_000, 300, frozenset({EOS}), None, budget)
    with pytest.raises(RequestError) as refused:
        intake.sequences([11] * 1000, SamplingParams(), "r", 1)
    message = str(refused.value)
    assert "has 1000 tokens" in message and "at most 1000 tokens" in message and "1256 MiB" in message, message
    assert refused.value.param == "prompt"
    # n copies each need caches of their own.
    with pytest.raises(RequestError, match="3 choices"):
        intake.sequences([11] * 400, SamplingParams(), "r", 3)
    # One that fits gets what the memory leaves for its output, as it gets what the context leaves.
    (seq,) = intake.sequences([11] * 900, SamplingParams(), "r", 1)
    assert seq.max_tokens == 100


def test_after_an_allocation_failed_the_budget_stays_below_what_the_batch_held_for_a_while() -> None:
    budget = holding(10_000)
    cap = budget.lower_after_failure(4000 * PER_TOKEN, now=100.0)
    assert cap == int(4000 * PER_TOKEN * memory.AFTER_FAILURE) and budget.bytes == cap
    more = {0: reading(20_000 * PER_TOKEN + HEADROOM_MIN)}
    budget.read(more, now=100.0 + memory.AFTER_FAILURE_S - 1)  # more room read soon after: the cap still holds
    assert budget.bytes == cap
    budget.read(more, now=100.0 + memory.AFTER_FAILURE_S)  # and it lifts once its time is up
    assert budget.bytes == 20_000 * PER_TOKEN


def test_a_scored_prompt_is_fed_in_chunks_whose_logits_the_calibrated_step_holds() -> None:
    budget = Budget([Share(PER_TOKEN, 0, 0)], ["here"], chunk=512, context=100_000)
    vocab = 1000
    # the calibration step fed an eighth of a chunk: a chunk's step takes eight times what it took
    budget.calibrate({0: reading(10**9, peak=100 * vocab * memory.SCORE_BYTES // memory.CALIBRATION_SHARE)})
    assert budget.calibration_tokens == 512 // memory.CALIBRATION_SHARE
    assert budget.scored_chunk(vocab) == 100
    s = scheduler(budget, prefill_chunk=512)
    s.scored_chunk = budget.scored_chunk(vocab)
    scored = request(300)
    scored.params = SamplingParams(temperature=0.0, prompt_logprobs=1)
    s.queues.add(scored)
    step = s.schedule().step
    assert step is not None and [len(c.tokens) for c in step.plan.prefill] == [100]


def test_each_of_n_choices_is_reserved_caches_of_its_own() -> None:
    row = 100 + RESERVE + STEP
    s = scheduler(holding(2 * row + row // 2))
    three = request(100)
    three.copies = [request(100) for _ in range(2)]
    for copy in three.copies:
        copy.copy_of = three
    two = request(100)
    two.copies = [request(100)]
    two.copies[0].copy_of = two
    s.queues.add(three)
    s.queues.add(two)
    # Three choices need three rows, which the budget does not hold: they wait, and hold back the two behind.
    assert s.schedule().admitted == []
    s.queues.cancel(three)
    assert s.schedule().admitted == [two, *two.copies]


def test_a_request_that_no_longer_fits_even_alone_ends_rather_than_waiting_forever() -> None:
    budget = holding(2000)
    s = scheduler(budget)
    waiting = request(1000)
    budget.read({0: reading(500 * PER_TOKEN + HEADROOM_MIN)})  # the budget shrank after it was taken in
    s.queues.add(waiting)
    turn = s.schedule()
    assert turn.unfit == [waiting] and waiting.status is Status.FINISHED_ERROR and not s.waiting


def test_a_stage_holding_another_kind_of_cache_than_the_others_is_counted_in_its_own_kind() -> None:
    # A pipeline stage of sliding windows only holds a window per sequence and nothing per token; the other holds
    # keys and values per token and nothing else. Neither's budget counts as nothing on the other's scale.
    budget = Budget([Share(1000, 0, 0), Share(0, 50_000, 0)], ["a", "b"], 16, 100_000)
    budget.read({0: reading(1000 * 1000 + HEADROOM_MIN), 1: reading(10 * 50_000 + HEADROOM_MIN)})
    assert budget.reference == Share(1000, 50_000, 0)
    assert budget.bytes > 0 and budget.fits([[100] * 2])
    assert not budget.fits([[100] * 11])  # stage b holds ten windows


def test_rank_0_keeps_room_for_the_images_of_requests_in_flight_and_the_other_ranks_do_not() -> None:
    """A model that takes images decodes them on rank 0 (``Pressure`` sets ``images`` from its total): that rank's
    caches get what is left after them, so that under tensor parallelism it rules where the others have as much."""
    tp = Budget([Share(1000, 0, 0)] * 2, ["a", "b"], 16, 100_000)
    tp.images = 100 * MIB
    tp.read({0: reading(400 * MIB + HEADROOM_MIN), 1: reading(400 * MIB + HEADROOM_MIN)})
    assert [rank.images for rank in tp.ranks] == [100 * MIB, 0]
    assert tp.where() == (0, "a") and tp.bytes == 300 * MIB
