"""The scheduler's decisions, checked directly: no process, no model, no event loop; milliseconds each.

The end-to-end tests (tests/e2e/serving/test_batching.py, test_server.py) prove the plans run on real
ranks; these pin down which plan each situation gets.
"""

from __future__ import annotations

import itertools

import pytest

from neuron.engine.drafts import MIN_SAMPLES
from neuron.engine.output import Output
from neuron.engine.refusals import Overloaded
from neuron.engine.scheduler import SHORT_STEP_MS, Delivery, Scheduler, Scheduling, ahead_for
from neuron.engine.sequence import Chunk, Event, Finish, Sequence, Status, StopText
from neuron.rpc import Decode, Prefill, StepPlan
from neuron.sampling_params import SamplingParams
from neuron.step import NOT_ASKED, Sampled, Start
from testkit.scheduling import (
    EOS,
    admitted,
    apply,
    next_plan,
    next_step,
    request,
    run,
    run_delivering,
    scheduler,
    sequence_numbers,
)


class Letters:
    """The output path's detokenizer, with token t as the letter chr(t) (``engine.text.Text`` does this with a real
    tokenizer): stop strings are found by the sequence's own ``StopText``, as in the engine."""

    def start(self, seq: Sequence) -> None:
        pass

    def push(self, seq: Sequence, token: int, produced: int) -> tuple[str, bool]:
        return seq.stop.push(chr(token))

    def finish(self, seq: Sequence) -> tuple[str, bool]:
        return seq.stop.flush(), False


LETTERS = Letters()


def rendered(s: Scheduler, deliveries: list[Delivery]) -> list[Event]:
    """What the readers get from ``deliveries`` on the engine's output path (text, stop strings, finishes), in
    order, every sequence's events together."""
    output = Output(LETTERS, s.queues.finish)
    for delivery in deliveries:
        output.deliver(delivery)
    events: list[Event] = []
    for seq in dict.fromkeys(d.seq for d in deliveries):
        while True:
            try:
                events.append(seq.events.receive_nowait())
            except Exception:  # noqa: BLE001 - nothing more sent yet, or the stream has ended
                break
    return events


def test_admission_is_first_come_and_bounded_by_the_batch() -> None:
    s = scheduler(max_batch=2)
    a, b, c = request(3), request(3), request(3)
    for seq in (a, b, c):
        s.queues.add(seq)
    assert s.schedule().admitted == [a, b]
    assert list(s.waiting) == [c] and c.status == Status.WAITING and a.status == Status.FILLING
    assert s.schedule().admitted == []  # no place until one leaves
    s.queues.cancel(a)
    assert s.schedule().admitted == [c]  # the cancelled one is dropped in the same turn, freeing its place
    assert a.status == Status.FINISHED_ABORTED


def test_a_full_queue_refuses_and_a_cancelled_waiter_frees_its_place() -> None:
    s = scheduler(max_batch=1, max_waiting=2)
    first, second = request(3), request(3)
    s.queues.add(first)
    s.queues.add(second)
    with pytest.raises(Overloaded, match="2 requests are already waiting"):
        s.queues.add(request(3))
    assert s.queues.cancel(second) is True  # still queued: it leaves at once
    s.queues.add(request(3))


def test_a_long_prompt_is_fed_in_chunks_of_the_step_budget() -> None:
    s = scheduler(prefill_chunk=4)
    seq = request(10)
    admitted(s, seq)
    chunks = [run(s).prefill for _ in range(3)]
    assert [(c.position, len(c.tokens), c.last) for (c,) in chunks] == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert [t for (c,) in chunks for t in c.tokens] == seq.prompt
    assert s.running == [seq] and seq.next_token == 7 and seq.completion_tokens == 1
    assert seq.status == Status.RUNNING


def test_the_prefill_budget_is_shared_in_admission_order() -> None:
    s = scheduler(prefill_chunk=5)
    a, b = request(3), request(6)
    admitted(s, a, b)
    plan = run(s)
    fed = [(c.seq, c.position, len(c.tokens), c.last) for c in plan.prefill]
    assert fed == [(a.no, 0, 3, True), (b.no, 0, 2, False)]
    plan = run(s)
    assert [(c.seq, c.position, len(c.tokens)) for c in plan.prefill] == [(b.no, 2, 4)]
    assert plan.decode == [Decode(a.no, 7, 0)]  # a decodes while b's prompt is still fed


def test_a_short_prompt_admitted_while_a_long_one_is_fed_is_fed_whole_in_the_next_step() -> None:
    s = scheduler(prefill_chunk=8)
    long = request(40)
    admitted(s, long)
    run(s)
    short = request(3)
    admitted(s, short)
    plan = run(s)
    # No head-of-line blocking: the short prompt is fed whole now, the long one takes what is left of the budget;
    # the plan lists them as admitted.
    assert [(c.seq, c.position, len(c.tokens), c.last) for c in plan.prefill] == [
        (long.no, 8, 5, False),
        (short.no, 0, 3, True),
    ]
    assert [r.seq for r in run(s).decode] == [short.no]  # decoding while the long prompt is still fed


def test_a_prompt_that_ends_joins_the_batch_after_the_running_rows() -> None:
    s = scheduler()
    a = request(2)
    admitted(s, a)
    run(s)
    b = request(2)
    admitted(s, b)
    run(s, {a.no: 8})
    plan = run(s)
    assert [r.seq for r in plan.decode] == [a.no, b.no]
    assert plan.decode[0] == Decode(a.no, 8, 0)


def test_only_sequences_starting_in_the_plan_hand_their_sampling_to_rank_0() -> None:
    s = scheduler(prefill_chunk=4)
    a = request(6, temperature=0.5, seed=3)
    admitted(s, a)
    step = next_step(s)
    assert step.starts == {a.no: Start(a.params)}
    apply(s, step, {})
    assert next_step(s).starts == {}


def test_a_finished_sequence_leaves_at_the_next_step_boundary() -> None:
    s = scheduler()
    a, b = request(2, max_tokens=2), request(2)
    for seq in (a, b):
        admitted(s, seq)
    run(s)  # both prompts: a's first token
    _, deliveries = run_delivering(s)
    assert [(d.seq, d.finish) for d in deliveries] == [(a, "length"), (b, None)]
    assert s.running == [b]  # the scheduler took it out: nobody else decides an ending on token ids or lengths
    assert a.status == Status.FINISHED_LENGTH
    plan = next_plan(s)
    assert plan.leave == [a.no] and [r.seq for r in plan.decode] == [b.no]
    run(s)
    assert next_plan(s).leave == []  # said once


def test_end_of_sequence_finishes_without_counting_a_token() -> None:
    s = scheduler()
    a = request(2)
    admitted(s, a)
    (delivery,) = apply(s, next_step(s), {a.no: Sampled(EOS, NOT_ASKED)})
    assert delivery.finish == "stop" and delivery.first and a.completion_tokens == 0
    assert not delivery.kept  # not part of the text
    assert a.status == Status.FINISHED_STOPPED


def test_a_stop_string_ends_the_sequence_inside_a_kept_draft_and_the_rest_is_not_delivered() -> None:
    s = scheduler()
    a = Sequence("r", next(sequence_numbers), [10, 11], 100, SamplingParams(), StopText(("cd",)))
    admitted(s, a)
    run(s, default=ord("a"))
    step = next_step(s)
    run_of = Sampled(
        ord("b"),
        NOT_ASKED,
        more=(Sampled(ord("c"), NOT_ASKED), Sampled(ord("d"), NOT_ASKED), Sampled(ord("e"), NOT_ASKED)),
    )
    deliveries = apply(s, step, {a.no: run_of})
    assert [d.sampled.token for d in deliveries] == [ord(c) for c in "bcde"]  # token ids alone end nothing here
    # The output path finds the stop string in the text, ends the sequence there and tells the scheduler.
    events = rendered(s, deliveries)
    assert [e.text for e in events if isinstance(e, Chunk)] == ["b", "", ""]
    assert isinstance(events[-1], Finish) and (events[-1].reason, events[-1].completion_tokens) == ("stop", 4)
    assert a.output == [ord(c) for c in "abcd"] and a.status == Status.FINISHED_STOPPED
    assert s.running == [a]  # until the step boundary
    turn = s.schedule()
    assert s.running == [] and turn.step is None and turn.clear  # it was alone: a clear drops it on every rank


def test_the_last_token_max_tokens_allows_ends_with_length_and_releases_what_was_held() -> None:
    s = scheduler()
    a = Sequence("r", next(sequence_numbers), [10], 2, SamplingParams(), StopText(("xy",)))
    admitted(s, a)
    run(s, default=ord("a"))
    (delivery,) = run_delivering(s, default=ord("x"))[1]
    assert (delivery.kept, delivery.finish) == (True, "length")
    chunk, finish = rendered(s, [delivery])
    assert isinstance(chunk, Chunk) and isinstance(finish, Finish)
    assert (chunk.text, finish.reason, finish.text) == ("", "length", "x")


def test_a_constraint_error_ends_the_sequence_with_an_error() -> None:
    s = scheduler()
    a = request(2)
    admitted(s, a)
    (delivery,) = apply(s, next_step(s), {a.no: Sampled(0, NOT_ASKED, error="dead end")})
    assert delivery.finish == "error" and not delivery.kept and s.running == []
    assert a.status == Status.FINISHED_ERROR


def test_cancelled_before_its_first_chunk_it_leaves_without_a_word_to_the_ranks() -> None:
    s = scheduler(max_batch=2, prefill_chunk=4)
    a, b = request(4), request(4)
    admitted(s, a, b)
    run(s)  # the budget went to a; b was admitted but none of its prompt reached a rank
    assert b.fed == 0
    s.queues.cancel(b)
    turn = s.schedule()
    assert turn.cancelled == [(b, 0)] and turn.step is not None
    assert b.no not in turn.step.plan.leave  # no rank holds it: naming it would be a desync


def test_a_cancelled_running_sequence_is_dropped_at_the_boundary_and_named_to_the_ranks() -> None:
    s = scheduler()
    a, b = request(2), request(2)
    admitted(s, a, b)
    run(s)
    step = next_step(s)
    assert s.queues.cancel(a) is False  # admitted, and the step runs: it waits for the step boundary
    apply(s, step, {a.no: Sampled(7, NOT_ASKED), b.no: Sampled(7, NOT_ASKED)})
    turn = s.schedule()
    assert turn.cancelled == [(a, 1)]  # one step ran after its caller left
    assert turn.step is not None
    assert turn.step.plan.leave == [a.no] and [r.seq for r in turn.step.plan.decode] == [b.no]


def test_a_sequence_taken_out_mid_step_gets_no_token() -> None:
    s = scheduler()
    a = request(2)
    admitted(s, a)
    step = next_step(s)
    s.queues.clear()  # a shutdown failed everything while the step ran
    assert apply(s, step, {a.no: Sampled(5, NOT_ASKED)}) == []
    assert a.completion_tokens == 0


def test_nothing_admitted_means_no_plan_but_the_departures_are_kept() -> None:
    s = scheduler()
    assert s.schedule().step is None
    a = request(2, max_tokens=1)
    admitted(s, a)
    run(s)
    assert s.queues.leaving == [a.no]
    turn = s.schedule()
    assert turn.step is None and turn.clear and s.queues.leaving == []  # the engine clears every rank's cache instead
    assert not s.schedule().clear


def test_chunk_positions_continue_across_steps_for_every_prompt() -> None:
    s = scheduler(prefill_chunk=3, max_batch=3)
    seqs = [request(n) for n in (5, 1, 7)]
    for seq in seqs:
        admitted(s, seq)
    fed: dict[int, list[Prefill]] = {seq.no: [] for seq in seqs}
    while s.filling:
        for chunk in run(s).prefill:
            fed[chunk.seq].append(chunk)
    for seq in seqs:
        chunks = fed[seq.no]
        assert [t for c in chunks for t in c.tokens] == seq.prompt
        assert [c.position for c in chunks] == list(itertools.accumulate([0] + [len(c.tokens) for c in chunks[:-1]]))
        assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_micro_batches_are_filled_evenly_and_a_sequence_keeps_its_own() -> None:
    s = scheduler(micro_batches=2)
    seqs = [request(2) for _ in range(5)]
    admitted(s, *seqs)
    run(s)  # every prompt ends: each joins the emptier micro-batch, the first of them on a tie
    assert [seq.micro_batch for seq in seqs] == [0, 1, 0, 1, 0]
    plan = next_plan(s)
    assert [(row.seq, row.micro_batch) for row in plan.decode] == [(seq.no, seq.micro_batch) for seq in seqs]
    run(s, {seqs[0].no: EOS, seqs[2].no: EOS})  # micro-batch 0 keeps one, 1 has two
    late = request(2)
    admitted(s, late)
    run(s)
    run(s)
    assert late.micro_batch == 0 and seqs[1].micro_batch == 1  # the newcomer evens them out; nobody moves


def test_copies_wait_for_their_originals_prompt_then_start_from_it_together() -> None:
    s = scheduler(max_batch=4, prefill_chunk=3)
    original, copy = request(5), request(5)
    original.copies, copy.copy_of = [copy], original
    other = request(6)  # longer than the original: fed after it (the fewest tokens left first)
    for seq in (original, other):
        s.queues.add(seq)
    # Two places for the request with n = 2, one for the next: all three fit.
    assert s.schedule().admitted == [original, copy, other]
    first = run(s)
    assert first.prefill == [Prefill(original.no, 0, original.prompt[:3], False)]
    second = next_step(s)
    # Only the original's prompt is computed; its last chunk names the copy, which gets logits of its own.
    assert second.plan.prefill[0] == Prefill(original.no, 3, original.prompt[3:], True, [copy.no])
    assert second.starts[copy.no] == Start(copy.params, tuple(copy.prompt))  # its penalties see the shared prompt
    delivered = apply(s, second, {original.no: Sampled(7, NOT_ASKED), copy.no: Sampled(8, NOT_ASKED)})
    assert [(d.seq, d.sampled.token, d.first) for d in delivered] == [(original, 7, True), (copy, 8, True)]
    assert s.running == [original, copy] and copy.fed == 5
    assert [r.seq for r in run(s).decode] == [original.no, copy.no]


def test_a_request_with_copies_waits_for_places_for_all_of_them() -> None:
    s = scheduler(max_batch=2)
    original, copies = request(2), [request(2), request(2)]
    original.copies = copies
    s.queues.add(original)
    assert s.schedule().admitted == []


def test_a_steady_batch_is_marked_to_run_ahead_and_a_changing_one_is_not() -> None:
    s = scheduler(max_batch=2, run_ahead="on")
    a = request(2)
    admitted(s, a)
    assert not next_plan(s).ahead  # a prompt is fed
    run(s)
    assert next_plan(s).ahead  # a decodes alone, nobody waits
    s.queues.add(request(2))
    assert not next_plan(s).ahead  # the newcomer is admitted: its prompt is fed
    run(s)
    run(s)
    last = request(2, max_tokens=1)
    s.queues.add(last)  # waits: no place
    assert next_plan(s).ahead
    short = scheduler(run_ahead="on")
    admitted(short, request(2, max_tokens=2))
    run(short)
    assert not next_plan(short).ahead  # its last token comes with this step


def timed_run(s: Scheduler, ms: float) -> StepPlan:
    """``run``, the step timed at ``ms``."""
    step = next_step(s)
    s.update(step, {row.seq: Sampled(7, NOT_ASKED) for row in step.plan.decode}, ms)
    return step.plan


def test_auto_runs_ahead_once_steps_of_the_batchs_size_are_timed_short() -> None:
    s = scheduler(max_batch=4, run_ahead="auto", speculate="off")
    admitted(s, request(2))
    run(s)  # its prompt: no decode step timed yet
    plans = [timed_run(s, SHORT_STEP_MS / 2) for _ in range(5)]
    assert [p.ahead for p in plans] == [False] * MIN_SAMPLES + [True] * (5 - MIN_SAMPLES)
    long = scheduler(max_batch=4, run_ahead="auto", speculate="off")
    admitted(long, request(2))
    run(long)
    assert not any(timed_run(long, SHORT_STEP_MS * 2).ahead for _ in range(5))  # a step this long: not ahead
    s.queues.add(request(2))
    run(s)  # the newcomer's prompt
    assert not timed_run(s, SHORT_STEP_MS / 2).ahead  # two rows: not timed yet at that size


def test_the_batchs_steps_are_short_or_long_once_timed_at_its_size_and_neither_before() -> None:
    """Where rank 0's threads run follows it (``Pool.place_rank0``): not timed is neither short nor long."""
    for ms, timed in ((SHORT_STEP_MS / 2, True), (SHORT_STEP_MS * 2, False)):
        s = scheduler(max_batch=4, speculate="off")
        admitted(s, request(2))
        run(s)  # its prompt: no decode step timed yet
        assert s.steps_short is None
        said = []
        for _ in range(MIN_SAMPLES + 1):
            timed_run(s, ms)
            said.append(s.steps_short)
        assert said[0] is None and said[-1] is timed
        s.queues.add(request(2))
        run(s)
        assert s.steps_short is None  # two rows: not timed yet at that size


def test_auto_means_on_for_a_gpu_and_for_one_cpu_rank_is_left_to_the_measured_step() -> None:
    assert ahead_for("cuda", 2, 1) == ahead_for("metal", 1, 1) == "on"
    assert ahead_for("cpu", 1, 1) == "auto"
    assert ahead_for("cpu", 2, 1) == ahead_for("cpu", 1, 2) == "off"  # tensor-parallel ranks; pipeline stages


def test_with_run_ahead_off_no_step_is_marked_to_run_ahead() -> None:
    s = Scheduler(Scheduling(run_ahead="off"), {EOS})
    admitted(s, request(2))
    run(s)
    assert not next_plan(s).ahead
