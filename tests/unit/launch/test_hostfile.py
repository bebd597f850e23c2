"""The hostfile's object form with spares, and every way it can be wrong: each refusal names the entry and what to
fix. Written back, it reads the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron.launch.hostfile import Hostfile, read_hostfile, write_hostfile
from neuron.launch.hosts import Host, HostsError, check_hosts

LEADER = {"ssh": "localhost", "ips": ["10.0.0.1"]}
MAC2 = {"ssh": "me@mac2", "ips": ["10.0.0.2"]}
MAC3 = {"ssh": "me@mac3", "ips": ["10.0.0.3"]}
MAC4 = {"ssh": "me@mac4", "ips": ["10.0.0.4"], "model": "/models/m", "cpus": [2]}


def written(tmp_path: Path, content: object) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_the_object_form_gives_the_ranks_and_the_spares_in_order(tmp_path: Path) -> None:
    read = read_hostfile(written(tmp_path, {"hosts": [LEADER, MAC2], "spares": [MAC3, MAC4]}))
    assert [h.ssh for h in read.hosts] == ["localhost", "me@mac2"]
    assert read.spares == (Host("me@mac3", ("10.0.0.3",)), Host("me@mac4", ("10.0.0.4",), model="/models/m", cpus=(2,)))


def test_the_list_form_and_an_object_without_spares_have_none(tmp_path: Path) -> None:
    listed = read_hostfile(written(tmp_path, [LEADER, MAC2]))
    assert listed == read_hostfile(written(tmp_path, {"hosts": [LEADER, MAC2]})) and listed.spares == ()
    # mlx.launch's own keys in its object form are taken and left to neuron's settings.
    assert read_hostfile(written(tmp_path, {"hosts": [LEADER, MAC2], "backend": "ring", "envs": []})) == listed


def test_several_ranks_may_share_a_host(tmp_path: Path) -> None:
    read = read_hostfile(written(tmp_path, {"hosts": [LEADER, MAC2, MAC2], "spares": [MAC3]}))
    assert len(read.hosts) == 3


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ({"hosts": [LEADER], "spares": MAC2}, "'spares' must be a list of entries"),
        ({"hosts": [LEADER], "spares": ["mac3"]}, "spare 0 must be an object"),
        ({"hosts": [LEADER], "spares": [{"ssh": "mac3", "port": 22}]}, "spare 0 has unknown keys ['port']"),
        ({"hosts": [LEADER], "spares": [{"ssh": "mac3", "ips": ["x"]}]}, "spare 0: 'x' in 'ips' is not an IP"),
        ({"spares": [MAC2]}, "must be a non-empty JSON list of hosts"),
        ({"hosts": [], "spares": [MAC2]}, "must be a non-empty JSON list of hosts"),
        ({"hosts": [LEADER], "spare": [MAC2]}, "unknown keys ['spare']"),
        ({"hosts": [LEADER, MAC2], "spares": [MAC2]}, "spare 0 (me@mac2) is already a host of the group (entry 1)"),
        ({"hosts": [LEADER], "spares": [{"ssh": "127.0.0.1"}]}, "spare 0 (127.0.0.1) is already a host of the group"),
        ({"hosts": [LEADER], "spares": [MAC2, MAC3, MAC2]}, "spare 2 (me@mac2) repeats spare 0: list each spare once"),
        (
            {"hosts": [LEADER, MAC2], "spares": [{"ssh": "mac2", "ips": ["10.0.0.2"]}]},
            "entry 1 (me@mac2) and spare 0 (mac2) both give the address 10.0.0.2",
        ),
        ([LEADER, MAC2, {"ssh": "other", "ips": ["10.0.0.2"]}], "entry 1 (me@mac2) and entry 2 (other) both give"),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_a_bad_object_form_is_refused_naming_what_to_fix(tmp_path: Path, content: object, says: str) -> None:
    with pytest.raises(HostsError) as caught:
        read_hostfile(written(tmp_path, content))
    assert says in str(caught.value) and str(tmp_path) in str(caught.value), str(caught.value)


RING = [Host("localhost", ("10.0.0.1",)), Host("mac2", ("10.0.0.2",))]


@pytest.mark.parametrize(
    ("spares", "backend", "data_plane", "says"),
    [
        ((Host("mac3", ("10.0.0.3",)),), "ring", "direct", None),
        ((Host("mac3"),), "ring", "direct", "spare 0 (mac3) has 0 'ips' where the hosts have 1"),
        ((Host("mac3"),), "ring", "ssh", None),  # the tunnels reach it by its ssh name
        ((Host("mac3", ("10.0.0.3",)),), "jaccl", "direct", "spares need --backend ring or nccl"),
    ],
)
def test_what_a_spare_needs_is_what_a_rank_would(
    spares: tuple[Host, ...], backend: str, data_plane: str, says: str | None
) -> None:
    hosts = (
        RING if backend != "jaccl" else [Host("localhost", ("10.0.0.1",), (None, "a")), Host("mac2", (), ("a", None))]
    )
    if says is None:
        check_hosts(hosts, backend, data_plane, spares)
        return
    with pytest.raises(HostsError) as caught:
        check_hosts(hosts, backend, data_plane, spares)
    assert says in str(caught.value)


def test_written_back_it_reads_the_same_in_the_object_form(tmp_path: Path) -> None:
    path = written(tmp_path, [LEADER, MAC2])
    changed = Hostfile(read_hostfile(path).hosts, (Host("me@mac4", ("10.0.0.4",), model="/models/m", cpus=(2,)),))
    write_hostfile(path, changed)
    assert read_hostfile(path) == changed
    assert json.loads(path.read_text())["spares"] == [MAC4]
    assert [p.name for p in tmp_path.iterdir()] == ["hosts.json"]  # no temporary file left beside it
