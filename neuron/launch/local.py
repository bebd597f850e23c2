"""Workers as subprocesses of the leader, on this host, each pinned to its own cores."""

from __future__ import annotations

import os
import sys
from typing import Protocol

import anyio
import anyio.abc

from neuron import cpu


class Launcher(Protocol):
    """What the pool needs to start its workers: a process per rank, and a name for where it runs."""

    world_size: int

    def host(self, rank: int) -> str: ...

    def rank0_cpus(self) -> list[int] | None: ...

    async def spawn(self, rank: int) -> anyio.abc.Process: ...


class LocalLauncher:
    """``python -m neuron --worker`` per rank, on this host.

    On a Linux CPU host each rank gets its own block of cores and as many BLAS
    threads as cores: with more threads than cores, the ring backend's
    busy-polling socket threads and the BLAS threads starve each other.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._cpus = cpu.plan_cpus(world_size) if cpu.is_linux_cpu_backend() else None

    def host(self, rank: int) -> str:
        return "localhost"

    def rank0_cpus(self) -> list[int] | None:
        return self._cpus[0] if self._cpus else None

    async def spawn(self, rank: int) -> anyio.abc.Process:
        return await anyio.open_process(
            [sys.executable, "-m", "neuron", "--worker", "--rank", str(rank), "--world-size", str(self.world_size)],
            stdin=-1,
            stdout=-1,
            stderr=None,  # inherited: an unread stderr pipe would block the worker once full
            env=self._env(rank),
        )

    def _env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        # The workers speak to the leader, not to systemd: only the leader may notify.
        env.pop("NOTIFY_SOCKET", None)
        env["PYTHONUNBUFFERED"] = "1"
        if self._cpus:
            env[cpu.CPUS_ENV] = ",".join(map(str, self._cpus[rank]))
            env["OPENBLAS_NUM_THREADS"] = str(len(self._cpus[rank]))
        return env
