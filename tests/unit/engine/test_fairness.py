"""A fair share per API key (``engine.fairness``), checked on the scheduler directly: the order requests of several
keys join in, who is preempted for a key under its share, and who may wait (the end-to-end run, with its time to
first token, is tests/e2e/serving/test_keys.py)."""

from __future__ import annotations

import pytest

from neuron.engine.refusals import Overloaded
from neuron.engine.scheduler import Scheduler
from neuron.engine.sequence import Sequence, Status
from testkit.scheduling import request, run, scheduler


def _request(key: str | None, priority: int = 0) -> Sequence:
    seq = request(3)
    seq.key, seq.priority = key, priority
    return seq


def _running(s: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        s.queues.add(seq)
    while any(seq.status != Status.RUNNING for seq in seqs):
        run(s)


def test_one_key_or_none_is_served_in_arrival_order() -> None:
    for key in (None, "only"):
        s = scheduler(max_batch=8)
        seqs = [_request(key) for _ in range(4)]
        for seq in seqs:
            s.queues.add(seq)
        assert s.admissible() == seqs


def test_the_key_holding_fewer_places_joins_first_and_keys_take_turns() -> None:
    s = scheduler(max_batch=3)
    _running(s, _request("heavy"))
    heavy = [_request("heavy") for _ in range(3)]
    light = [_request("light") for _ in range(2)]
    for seq in (*heavy, *light):
        s.queues.add(seq)
    # heavy holds one place: light's first goes ahead of heavy's queued ones, then they alternate
    assert s.admissible() == [light[0], heavy[0]]
    assert s.admission.order() == [light[0], heavy[0], light[1], heavy[1], heavy[2]]


def test_a_full_batch_gives_a_waiting_key_a_place_of_the_key_holding_the_most() -> None:
    s = scheduler(max_batch=4)
    heavy = [_request("heavy") for _ in range(4)]
    _running(s, *heavy)
    light = _request("light")
    s.queues.add(light)
    turn = s.schedule()
    assert turn.preempted == [heavy[-1]] and turn.admitted == [light]  # the newest admitted steps out
    paused = heavy[-1].paused
    assert paused is not None and paused.reason == "fair_share" and "'light'" in paused.cause
    assert list(s.waiting) == [heavy[-1]]  # it resumes, its stream open, as a place frees
    run(s)
    assert s.schedule().preempted == []  # three places against one: the two keys never trade places back


def test_the_batch_settles_at_each_keys_share() -> None:
    s = scheduler(max_batch=4)
    heavy = [_request("heavy") for _ in range(4)]
    _running(s, *heavy)
    for seq in [_request("light") for _ in range(3)]:
        s.queues.add(seq)
    for _ in range(4):
        run(s)
    keys = [seq.key for seq in s.batch]
    assert sorted(keys) == ["heavy", "heavy", "light", "light"]


def test_no_preemption_for_fairness_with_one_key_and_never_of_a_better_priority() -> None:
    s = scheduler(max_batch=2)
    _running(s, _request("a"), _request("a"))
    s.queues.add(_request("a"))
    assert s.schedule().preempted == []
    s = scheduler(max_batch=2, scheduling_policy="priority")
    _running(s, _request("heavy", priority=-1), _request("heavy", priority=-1))
    s.queues.add(_request("light", priority=0))
    assert s.schedule().preempted == []  # its share does not buy a worse priority a better one's place


def test_a_key_is_refused_past_its_share_of_the_queue_while_other_keys_have_requests_in_flight() -> None:
    s = scheduler(max_batch=1, max_waiting=4)
    _running(s, _request("light"))
    for _ in range(2):
        s.queues.add(_request("heavy"))
    with pytest.raises(Overloaded, match=r"API key 'heavy' has 2 requests waiting, its share of the queue's 4"):
        s.queues.add(_request("heavy"))
    s.queues.add(_request("light"))  # light's share is its own


def test_a_key_under_its_share_is_queued_where_another_key_filled_the_queue_alone() -> None:
    s = scheduler(max_batch=1, max_waiting=4)
    _running(s, _request("heavy"))
    for _ in range(4):
        s.queues.add(_request("heavy"))
    with pytest.raises(Overloaded, match="4 requests are already waiting"):  # alone, the queue's own limit
        s.queues.add(_request("heavy"))
    light = _request("light")
    s.queues.add(light)
    assert light in s.waiting
