"""``--scheduling-policy priority``'s decisions, checked on the scheduler directly: who waits where, who joins, and
who is preempted for whom (the end-to-end run is tests/e2e/serving/test_scheduling.py)."""

from __future__ import annotations

from neuron.engine.scheduler import Scheduler
from neuron.engine.sequence import Sequence, Status
from testkit.scheduling import request, run, scheduler


def _request(priority: int, prompt_tokens: int = 3) -> Sequence:
    seq = request(prompt_tokens)
    seq.priority = priority
    return seq


def _queued(s: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        s.queues.add(seq)


def test_waiting_requests_join_by_priority_then_arrival() -> None:
    s = scheduler(max_batch=1, scheduling_policy="priority")
    late, soon, soon_too, latest = _request(5), _request(-1), _request(-1), _request(5)
    _queued(s, late, soon, soon_too, latest)
    assert list(s.waiting) == [soon, soon_too, late, latest]


def test_first_come_first_served_ignores_priority() -> None:
    s = scheduler(max_batch=1)
    late, soon = _request(5), _request(-1)
    _queued(s, late, soon)
    assert list(s.waiting) == [late, soon]
    run(s)
    assert late.status != Status.WAITING
    assert s.schedule().preempted == []  # a better one waits, and nothing is preempted for it


def test_a_better_request_preempts_the_lowest_priority_newest_sequence_of_a_full_batch() -> None:
    s = scheduler(max_batch=2, scheduling_policy="priority")
    low_old, low_new = _request(3), _request(3)
    _queued(s, low_old)
    run(s)
    _queued(s, low_new)
    run(s)
    urgent = _request(-2)
    _queued(s, urgent)
    turn = s.schedule()
    assert turn.preempted == [low_new] and turn.admitted == [urgent]
    assert low_new.status == Status.WAITING and low_new.paused is not None and low_new.paused.reason == "priority"
    assert turn.step is not None and low_new.no in turn.step.plan.leave  # every rank drops it
    assert list(s.waiting) == [low_new]  # it resumes first once a place frees


def test_nothing_of_the_same_priority_or_better_is_preempted() -> None:
    s = scheduler(max_batch=1, scheduling_policy="priority")
    running = _request(0)
    _queued(s, running)
    run(s)
    same = _request(0)
    _queued(s, same)
    assert s.schedule().preempted == [] and list(s.waiting) == [same]


def test_a_preempted_request_waits_ahead_of_later_ones_of_its_priority_and_behind_better_ones() -> None:
    s = scheduler(max_batch=1, scheduling_policy="priority")
    low = _request(4)
    _queued(s, low)
    run(s)
    later_low, urgent = _request(4), _request(-4)
    _queued(s, later_low, urgent)
    assert s.schedule().preempted == [low]
    assert list(s.waiting) == [low, later_low]
