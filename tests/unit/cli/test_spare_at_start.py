"""A host out of reach when the leader starts (``cli.serve.spare_at_start``): past ``--spare-timeout`` since it was
first out, across the leader's restarts, its rank moves to a spare in the hostfile, which the fresh leader reads."""

from __future__ import annotations

import json
from pathlib import Path

from neuron.cli.serve import spare_at_start
from neuron.launch.checks import Unreachable
from neuron.launch.hostfile import read_hostfile
from neuron.launch.hosts import Host
from neuron.launch.launcher import Launcher
from neuron.pool import Layout

LEADER, MAC2, MAC3 = Host("localhost", ("10.0.0.1",)), Host("mac2", ("10.0.0.2",)), Host("mac3", ("10.0.0.3",))
NOW = 10_000.0


def layout(path: Path | None, spares: tuple[Host, ...] = (MAC3,)) -> Layout:
    return Layout(Launcher([LEADER, MAC2]), spares=spares, spare_timeout=20.0, hostfile=str(path) if path else None)


def test_a_host_out_past_the_bound_gives_its_rank_to_a_spare_in_the_hostfile(tmp_path: Path) -> None:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"hosts": [{"ssh": "localhost", "ips": ["10.0.0.1"]}], "spares": []}))
    unreachable = Unreachable("cannot reach mac2: ssh: connect timed out", ["mac2"])
    assert spare_at_start(layout(path), unreachable, NOW - 19, NOW) == []  # within the bound: it keeps its rank
    assert json.loads(path.read_text())["spares"] == []
    (move,) = spare_at_start(layout(path), unreachable, NOW - 20, NOW)
    assert (move.rank, move.lost, move.spare) == (1, "mac2", "mac3") and "--spare-timeout" in move.reason
    assert read_hostfile(path).hosts == (LEADER, MAC3) and read_hostfile(path).spares == (MAC2,)


def test_without_spares_or_a_hostfile_nothing_moves(tmp_path: Path) -> None:
    unreachable = Unreachable("cannot reach mac2", ["mac2"])
    assert spare_at_start(layout(tmp_path / "hosts.json", spares=()), unreachable, 0.0, NOW) == []
    assert spare_at_start(layout(None), unreachable, 0.0, NOW) == []
    assert not (tmp_path / "hosts.json").exists()
