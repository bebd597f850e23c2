"""Starting ranks, the decisions only: the hostfile and what each backend needs of it, the data plane's addresses
and probes (real sockets on loopback), the handshake's checks and the pipeline's split. No process, no model;
tests/e2e/hosts/ shows the same across network namespaces over SSH.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

import pytest

from neuron import rpc
from neuron.launch import checks, dataplane, stages
from neuron.launch.hostfile import read_hostfile
from neuron.launch.hosts import Host, HostsError, MemoryGauge, check_hosts, describe_host, local_hosts
from neuron.launch.launcher import Launcher
from neuron.system import cpu, sockets


def hostfile(tmp_path: Path, content: object) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_a_hostfile_as_mlx_launch_writes_it_with_neurons_own_keys(tmp_path: Path) -> None:
    entries = [
        {"ssh": "localhost", "ips": ["10.0.0.1"]},
        {"ssh": "me@mac2", "ips": ["10.0.0.2"], "neuron": "/opt/neuron/bin/neuron", "model": "/m", "cpus": [0, 1]},
    ]
    assert read_hostfile(hostfile(tmp_path, entries)) == read_hostfile(hostfile(tmp_path, {"hosts": entries}))
    leader, other = read_hostfile(hostfile(tmp_path, entries)).hosts
    assert leader.local and not other.local
    assert other == Host("me@mac2", ("10.0.0.2",), (), "/opt/neuron/bin/neuron", "/m", (0, 1))


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("[", "is not valid JSON"),
        ([], "must be a non-empty JSON list"),
        ({"hosts": "mac2"}, "must be a non-empty JSON list"),
        (["mac2"], "entry 0 must be an object"),
        ([{"ssh": "mac2", "port": 22}], "entry 0 has unknown keys ['port']"),
        ([{"ssh": "-oProxyCommand=x"}], "'ssh' must be a host to reach over SSH"),
        ([{"ssh": "mac 2"}], "'ssh' must be a host"),
        ([{"ssh": "mac2", "ips": "10.0.0.2"}], "'ips' must be a list of addresses"),
        ([{"ssh": "mac2", "ips": ["mac2.local"]}], "'mac2.local' in 'ips' is not an IP address"),
        ([{"ssh": "mac2", "rdma": "rdma_en2"}], "'rdma' must be a list"),
        ([{"ssh": "mac2", "cpus": [-1]}], "'cpus' must be a list of core numbers"),
        ([{"ssh": "mac2", "neuron": " "}], "'neuron' must be a non-empty string"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None,
)
def test_a_bad_hostfile_is_refused_naming_the_entry(tmp_path: Path, content: object, says: str) -> None:
    with pytest.raises(HostsError) as caught:
        read_hostfile(hostfile(tmp_path, content))
    assert says in str(caught.value) and str(tmp_path) in str(caught.value)


def test_a_missing_hostfile_is_refused_saying_why(tmp_path: Path) -> None:
    with pytest.raises(HostsError, match=r"cannot read the hostfile .*No such file"):
        read_hostfile(tmp_path / "nowhere.json")


RING = [Host("localhost", ("10.0.0.1",)), Host("mac2", ("10.0.0.2",))]


@pytest.mark.parametrize(
    ("hosts", "backend", "says"),
    [
        (RING, "ring", None),
        ([Host("mac1", ("10.0.0.1",)), RING[1]], "ring", "entry 0 of the hostfile is the leader's own host"),
        ([RING[0], Host("mac2")], "ring", "rank 1 on mac2 has no 'ips'"),
        ([RING[0], Host("mac2", ("10.0.0.2", "10.0.1.2"))], "ring", "as many 'ips' as the others"),
        ([Host("localhost", ("10.0.0.1",), (None, "rdma_en2")), Host("mac2", (), ("rdma_en2", None))], "jaccl", None),
        ([Host("localhost", ("10.0.0.1",), (None,)), Host("mac2", (), ("x", None))], "jaccl", "'rdma' needs 2 cells"),
        ([Host("localhost", (), (None, "a")), Host("mac2", (), ("a", None))], "jaccl", "entry 0 needs an address"),
        (local_hosts(3), "ring", None),
    ],
)
def test_what_each_backend_needs_of_the_hosts(hosts: list[Host], backend: str, says: str | None) -> None:
    if says is None:
        check_hosts(hosts, backend)
        return
    with pytest.raises(HostsError) as caught:
        check_hosts(hosts, backend)
    assert says in str(caught.value)


def test_addresses_split_and_join_for_both_families() -> None:
    for ip in ("10.0.0.2", "::1", "fe80::1"):
        assert sockets.split_address(dataplane.join_address(ip, 5000)) == (ip, 5000)
    assert dataplane.join_address("::1", 80) == "[::1]:80"


def test_each_backend_gets_what_mx_distributed_init_reads() -> None:
    addresses = [["10.0.0.1:5000"], ["10.0.0.2:5001"], ["10.0.0.3:5002"]]
    hosts = [Host("localhost", ("10.0.0.1",), (None, "a", "b")), Host("mac2"), Host("mac2")]
    env, files = dataplane.backend_setup("ring", 1, addresses, hosts)
    assert env == {"MLX_RANK": "1", "MLX_WORLD_SIZE": "3"} and json.loads(files["MLX_HOSTFILE"]) == addresses
    env, files = dataplane.backend_setup("jaccl", 2, addresses, hosts)
    assert env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:5000"
    assert json.loads(files["MLX_IBV_DEVICES"])[0] == [None, "a", "b"]
    env, files = dataplane.backend_setup("nccl", 2, addresses, hosts)
    assert (env["NCCL_HOST_IP"], env["NCCL_PORT"], files) == ("10.0.0.1", "5000", {})
    assert "CUDA_VISIBLE_DEVICES" not in env  # given at spawn, before the worker's CUDA starts (dataplane.spawn_env)
    # The ring connects to the next rank (the last to rank 0), the others to the coordinator.
    ring = [dataplane.probe_targets("ring", r, addresses) for r in range(3)]
    assert ring == [addresses[1], addresses[2], addresses[0]]
    coordinator = [dataplane.probe_targets("jaccl", r, addresses) for r in range(3)]
    assert coordinator == [[], ["10.0.0.1:5000"], ["10.0.0.1:5000"]]
    assert dataplane.probe_targets("ring", 0, addresses[:1]) == []


def test_a_listener_answers_a_probe_and_a_closed_port_is_named() -> None:
    listeners = dataplane.Listeners()
    try:
        (address,) = listeners.open(["127.0.0.1"])
        assert dataplane.probe([address]) == {}
    finally:
        listeners.close()
    assert "refused" in dataplane.probe([address], timeout=1.0)[address].lower()


def test_a_listener_on_an_address_this_host_lacks_says_so() -> None:
    with pytest.raises(OSError, match=r"cannot listen on 192\.0\.2\.1: .*is it an address of this host\?"):
        dataplane.Listeners().open(["127.0.0.1", "192.0.2.1"])


def test_an_unreachable_rank_is_named_with_its_host() -> None:
    checks.check_probes({0: {}, 1: {}}, "ring", ["leader", "mac2"])
    with pytest.raises(checks.Unreachable) as caught:
        checks.check_probes({1: {"10.0.0.1:5000": "Connection refused"}}, "ring", ["leader", "mac2"])
    assert "rank 1 on mac2 cannot reach rank 0 on leader at 10.0.0.1:5000 (Connection refused)" in str(caught.value)
    assert caught.value.hosts == ["leader"]


def pong(rank: int, info: rpc.HostInfo, world_size: int = 2, protocol: int = rpc.PROTOCOL_VERSION) -> rpc.Pong:
    return rpc.Pong(id=1, rank=rank, world_size=world_size, protocol=protocol, pid=1, host=info)


def test_the_handshake_refuses_another_rank_protocol_or_version() -> None:
    mine = describe_host(0)
    checks.check_handshake({1: pong(1, mine)}, mine, 2, ["leader", "mac2"])
    checks.check_handshake({1: pong(1, dataclasses.replace(mine, python="3.12.0"))}, mine, 2, ["leader", "mac2"])
    refused = [
        (pong(2, mine), "rank 1 on mac2 answered as rank 2 of 2, not 1 of 2"),
        (pong(1, mine, protocol=rpc.PROTOCOL_VERSION + 1), "speaks protocol"),
        (pong(1, dataclasses.replace(mine, mlx="0.0.1")), "runs mlx 0.0.1, the leader"),
        (pong(1, dataclasses.replace(mine, mlx_lm="0.0.1")), "runs mlx-lm 0.0.1"),
    ]
    for answer, says in refused:
        with pytest.raises(checks.Refused, match=says.replace(".", r"\.")):
            checks.check_handshake({1: answer}, mine, 2, ["leader", "mac2"])


def test_a_host_describes_itself_without_mlx() -> None:
    info = describe_host(3)
    assert info.hostname == socket.gethostname() and info.free_memory > 0 and info.cpus


def test_the_memory_gauge_reads_this_process_and_its_host() -> None:
    first = MemoryGauge().read(lambda: (7, 3))
    assert first.used > 0 and first.free > 0 and first.total >= first.free, first  # the resident set, the host's
    assert (first.caches, first.peak) == (7, 3)


@pytest.mark.parametrize(
    ("text", "layers", "count", "says"),
    [
        ("10,20", 30, 2, None),
        ("10,x", 30, 2, "must be layer counts per stage"),
        ("0,30", 30, 2, "at least one layer"),
        ("10,10", 30, 2, "add up to the model's 30"),
        ("10,10,10", 30, 2, "must name 2 stages"),
    ],
)
def test_an_asked_split_is_checked(text: str, layers: int, count: int, says: str | None) -> None:
    try:
        stages.check_split(stages.parse_split(text), layers, count)
    except stages.SplitError as e:
        assert says is not None and says in str(e)
    else:
        assert says is None


# Gemma 4 E2B's shape: 35 layers, every fifth full attention, the last 20 reading layer 13's (sliding) or 14's (full)
# keys and values.
GEMMA4_E2B = {"model_type": "gemma4_text", "num_hidden_layers": 35, "num_kv_shared_layers": 20}


def test_gemma4s_reading_layers_stay_in_their_sources_stage() -> None:
    from neuron.models import architectures

    together = architectures.kept_together(GEMMA4_E2B)
    assert {source for source, _ in together} == {13, 14} and [r for _, r in together] == list(range(15, 35))
    assert (14, 19) in together and (13, 18) in together
    assert stages.keep_together([17, 18], together) == [13, 22]  # the memory's split moved back to keep them
    assert stages.keep_together([5, 10, 20], together) == [5, 8, 22]
    stages.check_split([13, 22], 35, 2, together)
    with pytest.raises(stages.SplitError) as refused:
        stages.check_split([17, 18], 35, 2, together)
    assert str(refused.value) == (
        "--pp-layers 17,18 puts layer 17 in stage 1 and layer 13, whose keys and values it reads, in stage 0: one "
        "stage must hold both; use --pp-layers 13,22"
    )
    stages.check_split([], 35, 14, together)  # 13 places to cut before layer 14: 14 stages at most
    with pytest.raises(stages.SplitError, match="no split into 15 stages puts each pair in one stage; use a smaller"):
        stages.check_split([], 35, 15, together)
    assert architectures.kept_together({**GEMMA4_E2B, "num_kv_shared_layers": 0}) == []


def test_the_split_follows_free_memory_and_gives_every_stage_a_layer() -> None:
    assert stages.split_by_memory([1] * 30, 0, [100, 200]) == [10, 20]
    assert stages.split_by_memory([1] * 30, 100, [200, 100]) == [15, 15]  # rank 0 keeps room for the rest
    assert stages.split_by_memory([1] * 4, 0, [1000, 1, 1]) == [2, 1, 1]
    assert stages.split_by_memory([1] * 3, 0, [0, 0, 0]) == [1, 1, 1]
    assert stages.ranges([10, 20]) == [(0, 10), (10, 30)]


@pytest.mark.parametrize(
    ("cores", "ranks", "blocks"),
    [
        ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1], [2, 3]]),
        ([4, 5], 2, [[4], [5]]),
        # More ranks than cores: they float. One core each, in turn, decoded slower (BENCHMARKS.md, "The test bed's
        # cores"): the two ranks sharing a core poll while the other works.
        ([0, 1], 3, [[], [], []]),
    ],
)
def test_the_ranks_of_one_host_split_its_cores(cores: list[int], ranks: int, blocks: list[list[int]]) -> None:
    launcher = Launcher.local(ranks)
    assert [launcher.cpus(rank, cores) for rank in range(ranks)] == blocks


def test_a_rank_alone_on_its_host_floats_and_an_entrys_own_cores_win() -> None:
    alone = Launcher([Host("localhost", ("127.0.0.1",)), Host("mac2", ("10.0.0.2",))])
    assert alone.cpus(0, [0, 1]) == [] and alone.cpus(1, [0, 1]) == []
    own = Launcher([Host("localhost", ("127.0.0.1",), cpus=(1,)), Host("localhost", ("127.0.0.1",))])
    assert own.cpus(0, [0, 1, 2, 3]) == [1] and own.cpus(1, [0, 1, 2, 3]) == [2, 3]


def test_ranks_that_outnumber_their_machines_cores_are_named_with_what_fits() -> None:
    """The README's tour at --tp 3 on two cores: each rank waits in every collective for one not running."""
    here = dataclasses.replace(describe_host(0), hostname="vm", platform="linux-x86_64", cpus=[0, 1])
    (crowded,) = checks.crowded("ring", [here] * 3, [Host("localhost")] * 3)
    assert (crowded.host, crowded.ranks, crowded.cores) == ("localhost", (0, 1, 2), 2)
    assert "runs 3 ranks (0, 1, 2) on 2 cores" in crowded.advice and "place at most 2 there" in crowded.advice
    assert crowded.describe()["advice"] == crowded.advice
    assert not checks.crowded("ring", [here] * 2, [Host("localhost")] * 2)  # a core each
    # GPUs compute under nccl, and a Mac's ranks on Metal: their cores are not what the ranks share.
    assert not checks.crowded("nccl", [here] * 3, [Host("localhost")] * 3)
    assert not checks.crowded("ring", [dataclasses.replace(here, platform="darwin-arm64")] * 3, [Host("localhost")] * 3)
    # Counted per machine: one rank here and two on mac2, which has two cores.
    assert not checks.crowded("ring", [here] * 3, [Host("localhost"), Host("me@mac2"), Host("me@mac2")])
    # Entries that pin their ranks count the cores they name: two ranks on core 0 share it, on 0 and 1 they do not.
    (pinned,) = checks.crowded("ring", [here] * 2, [Host("localhost", cpus=(0,))] * 2)
    assert pinned.cores == 1
    assert not checks.crowded("ring", [here] * 2, [Host("localhost", cpus=(0,)), Host("localhost", cpus=(1,))])


def test_a_ranks_cores_where_the_system_does_not_say_are_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS has no call for a thread's cores: there the ranks of one machine split its cores as counted."""
    assert cpu.allowed_cores() == sorted(os.sched_getaffinity(0))
    monkeypatch.delattr(os, "sched_getaffinity")
    counted = list(range(os.cpu_count() or 1))
    assert cpu.allowed_cores() == counted
    blocks = cpu.split_cores(counted, 2)
    assert Launcher.local(2).cpus(1) == (blocks[1] if blocks else [])
