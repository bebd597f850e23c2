"""What a process's memory control group allows it: the room left under its limit, and the OOM kills counted there.

A host's free memory is not what a process may use when a control group limits
it (a systemd unit's ``MemoryMax=``, a container's memory limit): the kernel's
OOM killer ends the process at the group's limit, whatever the host has free.
Both cgroup versions are read: v2 (``memory.max``, the usual layout now) and v1
(``memory.limit_in_bytes``, hybrid layouts), found from ``/proc/self/cgroup``
and ``/proc/self/mountinfo``. A limit on an ancestor binds too, so the room is
the least over the group and its ancestors. Page cache (the model's files, once
read) is charged to the group but given back under pressure, so it counts as
room, as ``MemAvailable`` counts it for the host. Elsewhere (a Mac) there is no
group, and every answer is None.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc/self")
# v1 writes "no limit" as the largest page-aligned signed 64-bit value; anything this large is no limit.
UNLIMITED = 1 << 60


@dataclass(frozen=True, slots=True)
class MemoryGroup:
    directory: Path  # the process's own memory cgroup, as this host mounts it
    mount: Path  # where its hierarchy is mounted: the ancestors read stop there
    version: int  # 1 or 2

    @property
    def oom_counter(self) -> Path:
        """The file whose ``oom_kill`` line counts the processes the OOM killer ended in this group."""
        return self.directory / ("memory.oom_control" if self.version == 1 else "memory.events")


@dataclass(frozen=True, slots=True)
class Room:
    available: int  # bytes the process may still allocate before the binding limit
    limit: int  # that limit, in bytes


def locate(cgroups: str, mountinfo: str) -> MemoryGroup | None:
    """The memory cgroup named in ``/proc/PID/cgroup`` (``cgroups``), found among the mounts (``mountinfo``): the
    v1 memory hierarchy where one is mounted (hybrid layouts keep memory there), else the v2 one."""
    v1 = v2 = None
    for line in cgroups.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    mounts = list(_cgroup_mounts(mountinfo))
    for fstype, options, root, point in mounts:
        if v1 is not None and fstype == "cgroup" and "memory" in options:
            return _group(point, root, v1, 1)
    for fstype, _, root, point in mounts:
        if v2 is not None and fstype == "cgroup2":
            group = _group(point, root, v2, 2)
            if group is not None and (group.directory / "memory.current").exists():
                return group
    return None


def _cgroup_mounts(mountinfo: str) -> Iterator[tuple[str, list[str], str, Path]]:
    """Each cgroup mount's type, options, the hierarchy's path mounted, and where (mountinfo's fields)."""
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields, (fstype, *rest) = before.split(), after.split() or [""]
        if fstype in ("cgroup", "cgroup2") and len(fields) > 4:
            options = rest[1].split(",") if len(rest) > 1 else []
            yield fstype, options, _unescape(fields[3]), Path(_unescape(fields[4]))


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def _group(point: Path, root: str, path: str, version: int) -> MemoryGroup | None:
    """The directory of cgroup ``path`` under a hierarchy whose ``root`` is mounted at ``point``."""
    relative = Path(path).relative_to(root) if Path(path).is_relative_to(root) else None
    if relative is None:  # outside what this mount shows (another namespace's view): not readable from here
        return None
    return MemoryGroup(point / relative, point, version)


def own_group(proc: Path = PROC) -> MemoryGroup | None:
    """This process's memory cgroup, or None (no cgroups, or none readable)."""
    try:
        return locate((proc / "cgroup").read_text(), (proc / "mountinfo").read_text())
    except OSError:
        return None


def room(group: MemoryGroup) -> Room | None:
    """The least room over ``group`` and its ancestors that have a limit, or None where none has."""
    v1 = group.version == 1
    names = ("memory.limit_in_bytes", "memory.usage_in_bytes") if v1 else ("memory.max", "memory.current")
    prefix = "total_" if v1 else ""  # v1's hierarchical counts; v2's are hierarchical already
    tightest: Room | None = None
    level = group.directory
    while True:
        limit, usage = _number(level / names[0]), _number(level / names[1])
        if limit is not None and usage is not None and limit < UNLIMITED:
            stat = _stat(level / "memory.stat")
            cache = stat.get(f"{prefix}active_file", 0) + stat.get(f"{prefix}inactive_file", 0)
            available = min(max(limit - usage + cache, 0), limit)
            if tightest is None or available < tightest.available:
                tightest = Room(available, limit)
        if level == group.mount or level.parent == level:
            return tightest
        level = level.parent


def forget_file_pages(folder: str | Path, group: MemoryGroup | None) -> None:
    """Drop the page cache of the safetensors files in ``folder`` (once their tensors are loaded into the process's
    own memory) where a memory cgroup ``group`` limits the process: the kernel charges a file's cached pages to the
    group that read them, so the weights would count twice against the limit, and the group's usage (systemd's
    ``MemoryCurrent``) would say nothing of what the process holds. Pages in use elsewhere stay."""
    if group is None or room(group) is None or not hasattr(os, "posix_fadvise"):
        return
    for path in Path(folder).glob("*.safetensors"):
        try:
            with open(path, "rb") as file:
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            continue


def oom_kills(text: str) -> int | None:
    """The ``oom_kill`` count in a ``memory.events`` (v2) or ``memory.oom_control`` (v1) file's text."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {name: int(value) for name, _, value in (line.partition(" ") for line in lines) if value.isdigit()}
