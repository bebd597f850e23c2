"""Spares added and removed while serving (``pool.roster``): each checked as a hostfile entry is, refused where it
conflicts with the group as it stands, and every change written back to the hostfile in its object form."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from neuron.launch.checks import Refused
from neuron.launch.hostfile import read_hostfile
from neuron.launch.hosts import Host, HostsError, describe_host
from neuron.launch.launcher import Launcher
from neuron.pool.probe import SpareUnfit
from neuron.pool.ranks import Layout
from neuron.pool.roster import HostsConflict, NoSuchSpare, NotShrunk, Probe, Roster
from neuron.pool.spares import Spares
from neuron.rpc import HostInfo

LEADER = Host("localhost", ("10.0.0.1",))
MAC2 = Host("me@mac2", ("10.0.0.2",))
MAC3 = {"ssh": "me@mac3", "ips": ["10.0.0.3"]}


async def answers(spare: Host) -> HostInfo:
    """A spare that answers the probe as a worker would (``pool.probe``: tests/e2e/hosts/ runs it for real)."""
    return describe_host(1)


async def unfit(spare: Host) -> HostInfo:
    raise SpareUnfit(f"cannot reach the spare {spare.ssh} as a worker")


def shrunk(lost: list[int]) -> Layout:
    """The model does not split over the ranks left (``Loader.shrunk``, which tests/e2e/hosts/ runs for real)."""
    raise Refused(f"the group cannot go on without rank(s) {lost}: 14 heads do not divide over 2 ranks", tuple(lost))


def on(launcher: Launcher, spares: Spares, path: Path | None, probe: Probe = answers) -> Roster:
    """A roster over ``launcher``'s hosts; what it reads of the ranks is their launcher and backend (no rank runs)."""
    ranks = SimpleNamespace(launcher=launcher, backend="ring")
    return Roster(ranks, spares, path, probe, shrunk)  # type: ignore[arg-type]


def add(r: Roster, entry: object) -> Host:
    return anyio.run(r.add, entry)


def roster(path: Path | None, spares: tuple[Host, ...] = ()) -> Roster:
    launcher = Launcher([LEADER, MAC2])
    return on(launcher, Spares(launcher.hosts, spares, 20.0), path)


def test_a_spare_added_then_removed_is_written_back_each_time(tmp_path: Path) -> None:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"ssh": "localhost", "ips": ["10.0.0.1"]}, {"ssh": "me@mac2", "ips": ["10.0.0.2"]}]))
    r = roster(path)
    assert add(r, MAC3) == Host("me@mac3", ("10.0.0.3",))
    assert read_hostfile(path).spares == (Host("me@mac3", ("10.0.0.3",)),)
    assert read_hostfile(path).hosts == (LEADER, MAC2)
    assert r.remove("me@mac3").ssh == "me@mac3"
    assert json.loads(path.read_text())["spares"] == []


@pytest.mark.parametrize(
    ("entry", "kind", "says"),
    [
        ({"ssh": "me@mac2", "ips": ["10.0.0.2"]}, HostsConflict, "me@mac2 is already in the group (rank 1)"),
        ({"ssh": "localhost", "ips": ["10.0.0.1"]}, HostsConflict, "already in the group (rank 0)"),
        ({"ssh": "me@mac4", "ips": ["10.0.0.4"]}, HostsConflict, "me@mac4 is already a spare"),
        ({"ssh": "me@mac3"}, HostsError, "has 0 'ips' where the hosts have 1"),
        ({"ssh": "me@mac3", "ips": ["10.0.0.2"]}, HostsError, "both give the address 10.0.0.2"),
        ({"ssh": "me@mac3", "port": 22}, HostsError, "the new spare has unknown keys ['port']"),
        ("me@mac3", HostsError, "the new spare must be an object"),
    ],
)
def test_a_bad_or_conflicting_spare_is_refused_and_nothing_changes(
    tmp_path: Path, entry: object, kind: type[Exception], says: str
) -> None:
    path = tmp_path / "hosts.json"
    path.write_text("unchanged")
    r = roster(path, (Host("me@mac4", ("10.0.0.4",)),))
    with pytest.raises(kind) as caught:
        add(r, entry)
    assert says in str(caught.value), str(caught.value)
    assert [s.ssh for s in r.spares.spares] == ["me@mac4"] and path.read_text() == "unchanged"


def test_a_spare_the_probe_finds_unfit_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    path = tmp_path / "hosts.json"
    path.write_text("unchanged")
    launcher = Launcher([LEADER, MAC2])
    r = on(launcher, Spares(launcher.hosts, (), 20.0), path, unfit)
    with pytest.raises(SpareUnfit, match="cannot reach the spare me@mac3"):
        add(r, MAC3)
    assert r.spares.spares == [] and path.read_text() == "unchanged" and SpareUnfit.status == 422


def test_removing_a_ranks_host_or_an_unknown_spare_is_refused(tmp_path: Path) -> None:
    r = roster(tmp_path / "hosts.json", (Host("me@mac4", ("10.0.0.4",)),))
    with pytest.raises(HostsConflict, match="me@mac2 runs rank 1, it is not a spare"):
        r.remove("me@mac2")
    with pytest.raises(NoSuchSpare, match=r"me@mac9 is not a spare \(the spares: me@mac4\)"):
        r.remove("me@mac9")
    assert (HostsConflict.status, NoSuchSpare.status) == (409, 404)


def test_a_leader_started_without_a_hostfile_has_no_spares_to_keep() -> None:
    with pytest.raises(HostsConflict, match="started without --hosts"):
        add(roster(None), MAC3)


def test_a_drain_takes_each_of_the_hosts_ranks_to_a_spare_or_leaves_them_out_and_is_refused_where_it_cannot(
    tmp_path: Path,
) -> None:
    launcher = Launcher([LEADER, MAC2, MAC2, Host("me@mac5", ("10.0.0.5",))])
    spares = Spares(launcher.hosts, (Host("me@mac3", ("10.0.0.3",)), Host("me@mac4", ("10.0.0.4",))), 20.0)
    r = on(launcher, spares, tmp_path / "hosts.json")
    assert r.drain_plan("me@mac2") == [1, 2]
    for host, kind, says in (
        ("localhost", HostsConflict, "is the leader's own host (rank 0 runs inside the leader)"),
        ("me@mac3", HostsConflict, "me@mac3 is a spare, no rank runs there"),
        ("me@mac9", NoSuchSpare, "me@mac9 is not a host of the group (the hosts: localhost, me@mac2, me@mac5)"),
    ):
        with pytest.raises(kind) as caught:
            r.drain_plan(host)
        assert says in str(caught.value), str(caught.value)
    spares.take([3], "drained")  # one spare left, two ranks on mac2: the group would go on without them
    assert r.drain_plan("me@mac2") == [1, 2]
    with pytest.raises(HostsConflict, match=r"14 heads do not divide over 2 ranks, and 1 spare\(s\) stand by"):
        r.shrink_plan([1, 2])
    local = Launcher([LEADER, Host("127.0.0.1", ("10.0.0.1",))])
    with pytest.raises(HostsConflict, match="the leader's own host"):  # another name for the leader's machine
        on(local, Spares(local.hosts, spares.spares, 20.0), tmp_path / "h.json").drain_plan("127.0.0.1")


def test_with_no_spare_left_a_stranded_rank_the_model_cannot_do_without_is_refused_and_nothing_changes(
    tmp_path: Path,
) -> None:
    clock = [0.0]
    hosts = [LEADER, MAC2, Host("me@mac4", ("10.0.0.4",))]
    launcher = Launcher(hosts)
    spares = Spares(launcher.hosts, [], 20.0, lambda: clock[0])
    r = on(launcher, spares, tmp_path / "hosts.json")
    spares.failed([2])
    assert anyio.run(r.shrink_due, "gone") is None  # not out of reach for the bound yet
    clock[0] += 20.0
    with pytest.raises(NotShrunk, match="14 heads do not divide over 2 ranks") as refused:
        anyio.run(r.shrink_due, "gone")
    assert refused.value.ranks == [2]
    assert launcher.hosts == hosts and r.shrinks == [] and spares.stranded() == [2]
    assert not (tmp_path / "hosts.json").exists()  # nothing written back: nothing changed


def test_a_drain_with_too_few_spares_that_the_model_cannot_do_without_is_refused_saying_what_is_missing() -> None:
    r = roster(None)
    with pytest.raises(HostsConflict, match=r"14 heads do not divide over 2 ranks, and 0 spare\(s\) stand by"):
        r.shrink_plan([1])
