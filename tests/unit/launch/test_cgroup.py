"""The room a memory cgroup leaves a rank, and the check that each rank has room for its weights before anything
loads: decisions, read from files laid out as the kernel does. A worker the OOM killer ended, with real processes,
and the weights each rank needs of a real model: tests/e2e/memory/test_cgroup.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron.launch import cgroup, checks
from testkit.launching import host_info

# /proc/self/cgroup and the cgroup lines of /proc/self/mountinfo on a hybrid layout (memory in v1) and on a
# unified one (v2 only), as Debian and a systemd service see them.
HYBRID_CGROUP = "5:devices:/\n4:memory:/user.slice/neuron.service\n0::/user.slice/neuron.service\n"
HYBRID_MOUNTS = (
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
UNIFIED_CGROUP = "0::/system.slice/neuron.service\n"


def unified_mounts(root: Path) -> str:
    return f"30 23 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)


def test_the_memory_cgroup_is_found_in_v1_where_a_hybrid_layout_keeps_it() -> None:
    group = cgroup.locate(HYBRID_CGROUP, HYBRID_MOUNTS)
    assert group == cgroup.MemoryGroup(
        Path("/sys/fs/cgroup/memory/user.slice/neuron.service"), Path("/sys/fs/cgroup/memory"), 1
    )
    assert group.oom_counter.name == "memory.oom_control"
    # A container's view: the hierarchy mounted from its own cgroup, which /proc names in full.
    inside = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
    found = cgroup.locate("4:memory:/docker/abc\n", inside)
    assert found is not None and found.directory == Path("/sys/fs/cgroup/memory")
    assert cgroup.locate("4:memory:/elsewhere\n", inside) is None  # not under what is mounted: unreadable
    assert cgroup.locate("", "") is None  # no cgroups at all (a Mac has no /proc)


def test_the_room_under_v2_is_the_least_over_the_group_and_its_ancestors(tmp_path: Path) -> None:
    service = tmp_path / "system.slice" / "neuron.service"
    write(tmp_path, memory_stat="")  # the root: no limit of its own
    write(tmp_path / "system.slice", memory_max="max", memory_current=str(5 << 30), memory_stat="")
    write(service, memory_max=str(4 << 30), memory_current=str(3 << 30), memory_stat="active_file 0\n")
    write(service, memory_events="low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    group = cgroup.locate(UNIFIED_CGROUP, unified_mounts(tmp_path))
    assert group is not None and group.version == 2 and group.directory == service
    assert cgroup.room(group) == cgroup.Room(1 << 30, 4 << 30)
    assert cgroup.oom_kills(group.oom_counter.read_text()) == 1
    # Page cache (the model's files, once read) is given back under pressure: room, as MemAvailable counts it.
    write(service, memory_stat=f"anon {2 << 30}\nactive_file {1 << 29}\ninactive_file {1 << 29}\n")
    assert cgroup.room(group) == cgroup.Room(2 << 30, 4 << 30)
    # A slice above with less left binds instead.
    write(tmp_path / "system.slice", memory_max=str(6 << 30), memory_current=str(5 << 30) + "\n")
    assert cgroup.room(group) == cgroup.Room(1 << 30, 6 << 30)
    write(tmp_path / "system.slice", memory_max="max")
    write(service, memory_max="max")
    assert cgroup.room(group) is None  # no limit anywhere: the host's own free memory tells


def test_the_room_under_v1_reads_its_hierarchical_counts(tmp_path: Path) -> None:
    mounts = f"35 31 0:32 / {tmp_path} rw,relatime - cgroup cgroup rw,memory\n"
    unlimited = str((1 << 63) - 4096)
    write(tmp_path, memory_limit_in_bytes=unlimited, memory_usage_in_bytes=str(9 << 30), memory_stat="")
    host = tmp_path / "nrn1"
    stat = f"cache {1 << 28}\ninactive_file 0\ntotal_inactive_file {1 << 28}\ntotal_active_file 0\n"
    write(host, memory_limit_in_bytes=str(1 << 30), memory_usage_in_bytes=str(900 << 20), memory_stat=stat)
    write(host, memory_oom_control="oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    group = cgroup.locate("4:memory:/nrn1\n", mounts)
    assert group is not None and group.version == 1
    assert cgroup.room(group) == cgroup.Room((124 + 256) << 20, 1 << 30)
    assert cgroup.oom_kills(group.oom_counter.read_text()) == 2


def test_a_rank_without_room_for_its_share_of_the_weights_is_refused_naming_its_host() -> None:
    hosts = ["localhost", "root@mac2"]
    checks.check_memory([600 << 20, 600 << 20], [host_info(700 << 20), host_info(601 << 20, 1 << 30)], hosts)
    with pytest.raises(checks.Refused) as refused:
        checks.check_memory([1500 << 20, 10], [host_info(900 << 20, 1 << 30), host_info(1 << 40)], hosts)
    assert str(refused.value).startswith(
        "rank 0 on localhost (mac2) needs 1.46 GiB for its share of the model's weights, but has 900 MiB "
        "available under its memory cgroup's limit of 1.00 GiB: split the model over more ranks"
    )
    with pytest.raises(checks.Refused, match=r"rank 1 on root@mac2 \(mac2\) needs 2.00 GiB .* has 1.00 GiB available:"):
        checks.check_memory([1, 2 << 30], [host_info(1 << 30), host_info(1 << 30)], hosts)
