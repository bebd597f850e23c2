"""The hosts a model is split over: one host as a hostfile entry describes it (``Host``), what every backend needs
of them, and what each host says about itself. Reading and writing the hostfile is ``hostfile.py``'s.

An entry is ``mlx.launch``'s, ``{"ssh": "user@mac2", "ips": ["10.0.0.2"]}``; neuron
reads a few more keys, all optional: ``rdma`` (jaccl's device names, as
``mlx.launch`` reads them), ``neuron`` (the command that starts neuron there;
default: the leader's own interpreter, ``python -m neuron``), ``model`` (the
model's path on that host, when it differs from ``--model``), and ``cpus`` (the
cores this rank is pinned to; by default the ranks of a host split its cores).
MLX is imported only to ask a GPU's free memory, on a GPU backend.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import neuron
from neuron.config.settings import default
from neuron.launch import cgroup
from neuron.rpc import HostInfo, Memory
from neuron.system import device

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class HostsError(ValueError):
    """A hostfile neuron cannot use; the message names the entry and what to change."""


@dataclass(frozen=True, slots=True)
class Host:
    ssh: str  # how the leader reaches it: an ssh destination, or localhost for this machine
    ips: tuple[str, ...] = ()  # where the data plane reaches it
    rdma: tuple[Any, ...] = ()  # jaccl: this rank's row of RDMA device names
    neuron: str | None = None  # the command that starts neuron there
    model: str | None = None  # the model's path there, if not --model's
    cpus: tuple[int, ...] = ()  # the cores this rank is pinned to; empty: its share of its host's

    @property
    def local(self) -> bool:
        """Spawned as a subprocess of the leader rather than over SSH."""
        return self.ssh in LOCAL_NAMES

    @property
    def machine(self) -> str:
        """Which machine it is, for telling hosts apart: every local name is this one."""
        return "localhost" if self.local else self.ssh


def check_hosts(
    hosts: list[Host], backend: str, data_plane: str = default("data_plane"), spares: tuple[Host, ...] = ()
) -> None:
    """What a backend (and the data plane) needs of every host, and of every spare (which may take any rank but
    0's), checked before anything starts."""
    if not hosts[0].local:
        raise HostsError(
            f"entry 0 of the hostfile is the leader's own host (rank 0 runs inside the leader): its 'ssh' must be "
            f"localhost, got {hosts[0].ssh!r}"
        )
    if data_plane == "ssh" and backend != "ring":
        raise HostsError(
            f"--data-plane ssh tunnels the ring's TCP links; {backend} does not carry its data over TCP links neuron "
            "can forward: use --backend ring with it, or --data-plane direct"
        )
    if backend == "ring" and data_plane == "direct":
        for rank, host in enumerate(hosts):
            if not host.ips and len(hosts) > 1:
                raise HostsError(f"rank {rank} on {host.ssh} has no 'ips': the ring needs each host's addresses")
        counts = {len(h.ips) for h in hosts}
        if len(counts) > 1:
            raise HostsError("every host needs as many 'ips' as the others: the ring stripes over matching links")
        for i, spare in enumerate(spares):
            if len(spare.ips) != len(hosts[0].ips):
                raise HostsError(
                    f"spare {i} ({spare.ssh}) has {len(spare.ips)} 'ips' where the hosts have {len(hosts[0].ips)}: "
                    "a spare takes a rank's place in the ring, over as many links"
                )
    if spares and backend == "jaccl":
        raise HostsError(
            "spares need --backend ring or nccl: jaccl's 'rdma' matrix names each rank's devices on each peer, "
            "which a spare taking any rank's place cannot have; remove 'spares' from the hostfile"
        )
    if backend == "jaccl":
        for rank, host in enumerate(hosts):
            if len(host.rdma) != len(hosts) or host.rdma[rank] is not None:
                raise HostsError(
                    f"rank {rank} on {host.ssh}: 'rdma' needs {len(hosts)} cells, null at its own position {rank}"
                )
        if not hosts[0].ips:
            raise HostsError("jaccl's coordinator runs on rank 0: entry 0 needs an address in 'ips'")


def local_hosts(world_size: int) -> list[Host]:
    """Every rank on this machine, its ranks talking over loopback: neuron without a hostfile."""
    return [Host("localhost", ("127.0.0.1",)) for _ in range(world_size)]


# Versions that must be equal on every host, or ranks could disagree: the protocol, the code on each side of
# it, and the libraries that compute.
SAME_VERSIONS = ("neuron", "mlx", "mlx_lm")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def free_memory(room: cgroup.Room | None) -> int:
    """Bytes this rank could give a model now: its GPU's room on a GPU backend (MLX says, so it loads there,
    where nothing must be settled before it), else the host's available memory, or less where the process's
    memory cgroup leaves it less ``room`` under its limit."""
    if (on_gpu := device.gpu_memory()) is not None:
        return on_gpu[0]
    host = _meminfo("MemAvailable")
    return host if room is None else min(host, room.available)


def total_memory(room: cgroup.Room | None) -> int:
    """The most this rank may hold in all: its GPU's memory on a GPU backend, else its host's, or less where its
    memory cgroup's limit is lower."""
    if (on_gpu := device.gpu_memory()) is not None:
        return on_gpu[1]
    host = _meminfo("MemTotal")
    return host if room is None else min(host, room.limit)


def _meminfo(field: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = "SC_AVPHYS_PAGES" if field == "MemAvailable" else "SC_PHYS_PAGES"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages)
    except (ValueError, OSError):
        return 0


# What a rank's caches hold and the most one step took beyond it (``Rank.cache_bytes``, ``Rank.peak``): read from
# the rank on its own thread, where the gauge is read.
Held = Callable[[], tuple[int, int]]


class MemoryGauge:
    """This process's memory, read live at low cost (a few small files, or MLX's counters) for the leader's memory
    budget and the status route: after a step that asks for it (the leader's loop does, every few seconds), and on
    ``rpc.ReadMemory``."""

    def __init__(self) -> None:
        self.group = cgroup.own_group()

    def read(self, held: Held | None = None) -> Memory:
        room = cgroup.room(self.group) if self.group is not None else None
        caches, peak = held() if held is not None else (0, 0)
        return Memory(
            used=device.used_memory(),
            free=free_memory(room),
            at=time.time(),
            total=total_memory(room),
            caches=caches,
            peak=peak,
        )


def describe_host(rank: int) -> HostInfo:
    """This host and this process, as ``rank`` reports them: the versions from package metadata, and without
    importing MLX on the CPU backend (a worker pins itself to its cores before MLX starts a thread)."""
    mlx = _version("mlx")
    group = cgroup.own_group()
    room = cgroup.room(group) if group is not None else None
    try:
        oom_kills = cgroup.oom_kills(group.oom_counter.read_text()) if group is not None else None
    except OSError:
        oom_kills = None
    return HostInfo(
        hostname=socket.gethostname(),
        neuron=neuron.__version__,
        mlx=mlx,
        mlx_lm=_version("mlx-lm"),
        python=platform.python_version(),
        platform=f"{sys.platform}-{platform.machine()}",
        free_memory=free_memory(room),
        memory_limit=room.limit if room is not None else 0,
        oom_counter=str(group.oom_counter) if group is not None and oom_kills is not None else "",
        oom_kills=-1 if oom_kills is None else oom_kills,
        cpus=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
        gpus=device.gpu_count(),
    )
