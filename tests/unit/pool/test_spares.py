"""When a rank moves to a spare (``pool.spares``), on a clock the test turns: a host back within ``--spare-timeout``
keeps its rank, one out past it gives its rank to the first spare and becomes a spare itself, tried last; and which
ranks a failed try names. ``--spare-timeout`` must be shorter than ``--resume-timeout``."""

from __future__ import annotations

import pytest

from neuron.launch.checks import Refused, Unreachable
from neuron.launch.hostfile import check_spare_timeout
from neuron.launch.hosts import Host, HostsError
from neuron.pool.fanout import PoolError
from neuron.pool.spares import Spares, ranks_named

BOUND = 20.0
LEADER, MAC2, MAC3, MAC4, MAC5 = (Host(name) for name in ("localhost", "mac2", "mac3", "mac4", "mac5"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def spares(clock: Clock, hosts: list[Host], standing: list[Host]) -> Spares:
    return Spares(hosts, standing, BOUND, clock)


def place(hosts: list[Host], spares: Spares, reason: str = "gone") -> list[tuple[int, str, str]]:
    """What the pool does with the moves: each spare takes its rank's place."""
    moves = spares.move(reason)
    for move in moves:
        hosts[move.rank] = move.host
    return [(m.rank, m.lost, m.spare) for m in moves]


def test_a_host_back_within_the_bound_keeps_its_rank_however_often_it_flaps(clock: Clock) -> None:
    hosts = [LEADER, MAC2]
    s = spares(clock, hosts, [MAC3])
    s.failed([1])  # the loss
    clock.now += 15
    s.failed([1])  # a try that could not reach it
    assert s.due() == [] and s.until_due() == pytest.approx(5.0)
    clock.now += 4
    s.failed([])  # a try that reached it (and failed for another reason): its outage ends
    clock.now += 10
    s.failed([1])  # lost again: the bound counts from here
    clock.now += 19
    assert place(hosts, s) == [] and hosts == [LEADER, MAC2]
    s.recovered()
    clock.now += 60
    assert s.due() == [] and s.until_due() is None


def test_out_of_reach_past_the_bound_the_rank_moves_to_the_first_spare_and_its_host_becomes_a_spare(
    clock: Clock,
) -> None:
    hosts = [LEADER, MAC2, MAC3]
    s = spares(clock, hosts, [MAC4, MAC5])
    s.failed([2])
    clock.now += BOUND
    assert place(hosts, s, "ssh: connect timed out") == [(2, "mac3", "mac4")]
    assert hosts == [LEADER, MAC2, MAC4]
    assert s.describe() == [{"host": "mac5", "state": "standing by"}, {"host": "mac3", "state": "returning"}]
    (move,) = s.moves
    assert (move.out_s, move.reason) == (BOUND, "ssh: connect timed out")
    assert s.due() == [] and s.until_due() == pytest.approx(BOUND)  # the spare's own bound starts now
    s.recovered()
    assert s.describe()[1] == {"host": "mac3", "state": "returning"}  # it has not answered yet: tried last


def test_a_spare_that_dies_as_it_is_brought_in_passes_the_rank_on_and_the_lost_host_comes_last(clock: Clock) -> None:
    hosts = [LEADER, MAC2]
    s = spares(clock, hosts, [MAC3, MAC4])
    s.failed([1])
    clock.now += BOUND
    assert place(hosts, s) == [(1, "mac2", "mac3")]
    s.failed([1])  # the try on mac3 could not reach it either
    clock.now += BOUND - 1
    s.failed([1])
    assert place(hosts, s) == []
    clock.now += 1
    assert place(hosts, s) == [(1, "mac3", "mac4")]
    s.failed([1])
    clock.now += BOUND
    assert place(hosts, s) == [(1, "mac4", "mac2")]  # back to the first host, the longest gone
    s.recovered()  # it answered this time: a host of the group again, no longer returning
    assert hosts[1] == MAC2 and s.describe() == [
        {"host": "mac3", "state": "returning"},
        {"host": "mac4", "state": "returning"},
    ]


def test_with_no_spare_left_nothing_moves_and_rank_0_never_does(clock: Clock) -> None:
    hosts = [LEADER, MAC2, MAC3]
    s = spares(clock, hosts, [MAC4])
    s.failed([0, 1, 2])
    clock.now += BOUND
    assert place(hosts, s) == [(1, "mac2", "mac4")]  # one spare, two ranks due: the first takes it
    assert s.due() == [2]  # the lost mac2 is a spare now: rank 2 may have it, still out of reach or not
    assert 0 not in s.out
    empty = spares(clock, [LEADER, MAC2], [])
    empty.failed([1])
    clock.now += 10 * BOUND
    assert empty.due() == [] and empty.until_due() is None and place([LEADER, MAC2], empty) == []


def test_with_no_spare_left_a_rank_out_past_the_bound_is_stranded_and_once_dropped_its_host_is_a_spare(
    clock: Clock,
) -> None:
    hosts = [LEADER, MAC2, MAC3, MAC4]
    s = spares(clock, hosts, [MAC5])
    s.failed([1, 3])
    assert s.stranded() == [] and s.until_stranded() == pytest.approx(BOUND)  # one spare for two: one stranded
    clock.now += BOUND
    assert s.stranded() == [3]  # the spare takes rank 1, the first due; none is left for rank 3
    assert place(hosts, s) == [(1, "mac2", "mac5")]
    assert s.due() == [3] and s.stranded() == []  # the lost mac2 is a spare now, which rank 3 may have
    assert place(hosts, s) == [(3, "mac4", "mac2")]
    s.failed([1, 3], answered=False)
    clock.now += BOUND
    assert s.due() == [1] and s.stranded() == [3]  # mac4 is the one spare left: rank 1 takes it, rank 3 is stranded
    # The group goes on without rank 3 (the pool drops its host): its outage ends, and its host stands by, last.
    lost = hosts.pop(3)
    s.dropped([3], [lost])
    assert s.out == {1: clock.now - BOUND} and [h.ssh for h in s.spares] == ["mac4", "mac2"]
    assert s.describe()[-1] == {"host": "mac2", "state": "returning"}
    # A rank below the one that left keeps its number; one above it moves down past it.
    t = spares(clock, [LEADER, MAC2, MAC3, MAC4], [])
    t.failed([1, 3])
    clock.now += BOUND
    assert t.stranded() == [1, 3] and t.until_stranded() == 0.0 and t.until_due() is None
    t.failed([1, 2, 3], answered=False)
    t.dropped([1], [MAC2])
    assert sorted(t.out) == [1, 2]  # rank 2 (now 1) and rank 3 (now 2)


def test_a_failure_that_names_no_rank_leaves_the_outages_as_they_were(clock: Clock) -> None:
    s = spares(clock, [LEADER, MAC2], [MAC3])
    s.failed([1])
    clock.now += 12
    s.failed([], answered=False)  # e.g. the probe step failed: nothing said who answered
    clock.now += 8
    assert s.due() == [1]


def test_spares_are_added_and_removed_by_name(clock: Clock) -> None:
    s = spares(clock, [LEADER, MAC2], [MAC3])
    s.add(MAC4)
    assert s.remove("mac3") == MAC3 and s.remove("mac9") is None
    assert [d["host"] for d in s.describe()] == ["mac4"]


def test_a_failed_try_names_the_ranks_it_could_not_reach_or_use() -> None:
    hosts = ["localhost", "mac2", "mac3", "mac2"]
    assert ranks_named(PoolError("ping", {3: "gone"}, broken=True), hosts) == [3]
    assert ranks_named(Unreachable("cannot reach mac2", ["mac2"]), hosts) == [1, 3]
    assert ranks_named(Refused("rank 2 on mac3 runs mlx 0.1", (2,)), hosts) == [2]
    assert ranks_named(Refused("the group cannot form"), hosts) is None
    assert ranks_named(RuntimeError("the first step after recovering failed"), hosts) is None


@pytest.mark.parametrize(
    ("spare_s", "resume_s", "says"),
    [
        (20.0, 60.0, None),
        (60.0, 60.0, "--spare-timeout 60 must be shorter than --resume-timeout 60"),
        (5.0, 0.0, "--resume-timeout is 0"),
    ],
)
def test_the_spare_timeout_must_be_shorter_than_the_resume_timeout(
    spare_s: float, resume_s: float, says: str | None
) -> None:
    if says is None:
        check_spare_timeout(spare_s, resume_s)
        return
    with pytest.raises(HostsError, match=says):
        check_spare_timeout(spare_s, resume_s)


def test_a_drained_hosts_ranks_take_the_first_spares_and_the_host_leaves_them(clock: Clock) -> None:
    hosts = [LEADER, MAC2, MAC2]
    s = spares(clock, hosts, [MAC3, MAC4, MAC5])
    moves = s.take([1, 2], "mac2 drained")
    assert [(m.rank, m.lost, m.spare, m.out_s) for m in moves] == [(1, "mac2", "mac3", 0.0), (2, "mac2", "mac4", 0.0)]
    assert s.describe() == [{"host": "mac5", "state": "standing by"}]  # mac2 is not a spare: it was taken out
    clock.now += BOUND  # a spare that does not answer passes its rank on, as after a loss
    assert s.due() == [1]
