"""Memory limits for the test bed's hosts: one memory cgroup per host, made by a test and removed after.

Each namespace "host" shares this machine's memory; a cgroup gives its processes
a limit of their own, as a smaller machine would. A host's sshd is moved into its
cgroup, so that everything a session starts there (a worker) is under the same
limit; the leader's host is the leader's own process, started inside its cgroup.
v2 (a memory-enabled unified hierarchy) makes the cgroup under the root; v1 (the
memory hierarchy of a hybrid layout) under this process's own memory cgroup,
which keeps the processes inside whatever limits this process already has.
``unavailable()`` says why a machine cannot, for a skip.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from neuron.launch import cgroup

V2_ROOT = Path("/sys/fs/cgroup")


def _parent() -> tuple[Path, int] | None:
    """Where a test's cgroups go, and the version; None where neither hierarchy can take one."""
    if os.geteuid() != 0:
        return None
    own = cgroup.own_group()
    if own is not None and own.version == 1 and os.access(own.directory, os.W_OK):
        return own.directory, 1
    try:
        controllers = (V2_ROOT / "cgroup.controllers").read_text().split()
    except OSError:
        return None
    if "memory" in controllers and os.access(V2_ROOT, os.W_OK):
        return V2_ROOT, 2
    return None


def unavailable() -> str | None:
    """Why this machine cannot limit a test host's memory, or None."""
    if os.geteuid() != 0:
        return "memory limits per host need root (cgroups)"
    if _parent() is None:
        return "no writable memory cgroup hierarchy (v2 with the memory controller, or v1's memory hierarchy)"
    return None


class MemoryLimit:
    """A memory cgroup with a limit of ``limit`` bytes; ``procs`` is the file a process writes its pid to."""

    def __init__(self, name: str, limit: int) -> None:
        found = _parent()
        assert found is not None, unavailable()
        parent, self.version = found
        self.limit = limit
        self.directory = parent / name
        if self.version == 2:  # a child's memory files exist only where its parent hands the controller down
            (parent / "cgroup.subtree_control").write_text("+memory")
        if self.directory.exists():  # left by a run killed before it could clean up; refused if still in use
            self.directory.rmdir()
        self.directory.mkdir()
        # No swap either, where the kernel accounts it: a host out of memory is killed, not slowed.
        if self.version == 1:
            (self.directory / "memory.limit_in_bytes").write_text(str(limit))
            if (swap := self.directory / "memory.memsw.limit_in_bytes").exists():
                swap.write_text(str(limit))
        else:
            (self.directory / "memory.max").write_text(str(limit))
            if (swap := self.directory / "memory.swap.max").exists():
                swap.write_text("0")
        self.procs = self.directory / "cgroup.procs"
        self._peak: int | None = None  # v2: the descriptor ``reset_peak`` wrote to

    def add(self, pid: int) -> None:
        self.procs.write_text(str(pid))

    def pids(self) -> list[int]:
        return [int(p) for p in self.procs.read_text().split()]

    def usage(self) -> int:
        """What the group holds now (page cache included), in bytes."""
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return int((self.directory / name).read_text())

    def peak(self) -> int | None:
        """The most memory the group has held (page cache included) since ``reset_peak``, else since it was made,
        in bytes: v1's ``max_usage_in_bytes``, v2's ``memory.peak`` where the kernel has it (5.19 on)."""
        if self._peak is not None:  # v2, reset through this descriptor: it reads the peak since then
            os.lseek(self._peak, 0, os.SEEK_SET)
            return int(os.read(self._peak, 64))
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.directory / name).read_text())
        except (OSError, ValueError):
            return None

    def reset_peak(self) -> None:
        """Count the peak from now. v2's ``memory.peak`` is reset for the descriptor that writes to it (6.12 on);
        an older kernel refuses the write, and the peak then counts from the group's making."""
        if self.version == 1:
            (self.directory / "memory.max_usage_in_bytes").write_text("0")
            return
        fd = os.open(self.directory / "memory.peak", os.O_RDWR)
        try:
            os.write(fd, b"reset\n")
        except OSError:
            os.close(fd)
            return
        self._peak = fd

    def oom_kills(self) -> int:
        counter = "memory.oom_control" if self.version == 1 else "memory.events"
        return cgroup.oom_kills((self.directory / counter).read_text()) or 0

    def close(self) -> None:
        """Kill what is left inside (a test's processes only: it made the group), then remove it."""
        if self._peak is not None:
            os.close(self._peak)
            self._peak = None
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while True:
            try:
                self.directory.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)  # the killed processes leave the group as they exit
