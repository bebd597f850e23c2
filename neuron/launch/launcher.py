"""The one interface the pool calls to start workers: a process per rank where the hostfile puts it, what to
call that place, and what each rank may use there (its cores, its model path, its log format)."""

from __future__ import annotations

import contextlib
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc

from neuron.config.settings import default
from neuron.launch.dataplane import machine_ranks, spawn_env
from neuron.launch.hosts import Host, local_hosts
from neuron.launch.local import spawn_local
from neuron.launch.ssh import StderrRelay, read_remote, receiver_argv, spawn_ssh
from neuron.system import cpu

DEFAULT_SSH: str = default("ssh_command")


@dataclass(slots=True)
class Spawned:
    process: anyio.abc.Process
    relay: StderrRelay | None  # a remote worker's stderr, relayed; None where it shares the leader's

    def last_words(self) -> str:
        """What the process (or ssh) said last on stderr, for an error message; empty when unknown."""
        return self.relay.last_words() if self.relay else ""


class Launcher:
    """Starts rank R's process on ``hosts[R]``: a subprocess for this host, ``ssh`` for the others."""

    def __init__(
        self, hosts: list[Host], ssh_command: str = DEFAULT_SSH, data_plane: str = default("data_plane")
    ) -> None:
        self.hosts = hosts  # by rank; a group that shrinks drops its lost ranks' entries (``Ranks.shrink``)
        self.ssh_command = shlex.split(ssh_command)
        self.data_plane = data_plane
        self._early: dict[int, tuple[dict[str, str], anyio.abc.Process]] = {}  # by rank: started ahead, with env

    @classmethod
    def local(cls, world_size: int) -> Launcher:
        return cls(local_hosts(world_size))

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def remote(self) -> bool:
        return any(not h.local for h in self.hosts)

    @property
    def tunnelled(self) -> bool:
        """The ring's links between hosts go through SSH tunnels (``tunnels.py``)."""
        return self.data_plane == "ssh" and self.remote

    @property
    def local_workers(self) -> list[int]:
        """The ranks above 0 whose workers run on this host."""
        return [rank for rank in range(1, self.world_size) if self.hosts[rank].local]

    def host(self, rank: int) -> str:
        """The host as the operator named it: logs and errors say so."""
        return self.hosts[rank].ssh

    async def spawn(self, rank: int, env: dict[str, str] | None = None) -> Spawned:
        """Start ``rank``'s worker with ``env`` added to its environment (on another host too: sshd passes no
        variables on, so they go on its command line)."""
        host = self.hosts[rank]
        if early := self._early.pop(rank, None):
            if early[0] == (env or {}):
                return Spawned(early[1], None)
            await _end(early[1])
        if host.local:
            return Spawned(await spawn_local(rank, self.world_size, env or {}), None)
        return Spawned(*await spawn_ssh(self.ssh_command, host, rank, self.world_size, env or {}))

    async def start_early(self, backend: str) -> None:
        """Start this host's workers now, before this process has imported mlx-lm or read the model: a worker's
        start-up is mostly those same imports, so each side's runs while the other's does; ``spawn`` hands them
        over. Called once, by the command line, before the pool exists; ``end_early`` ends any not handed over."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        for rank in self.local_workers:
            env = spawn_env(backend, rank, self.hosts, visible)
            self._early[rank] = (env, await spawn_local(rank, self.world_size, env))

    async def end_early(self) -> None:
        """End the workers ``start_early`` started that no pool took (it failed, or never began, first)."""
        while self._early:
            await _end(self._early.popitem()[1][1])

    def receiver(self, rank: int, key: str) -> list[str]:
        """The command that receives share ``key`` on ``rank``'s host (a remote one: this one has the model)."""
        return receiver_argv(self.ssh_command, self.hosts[rank], key)

    async def read_file(self, rank: int, path: str) -> str | None:
        """A small file on ``rank``'s host (where a dead worker's OOM kills are counted): read here, or over SSH;
        None where it cannot be read."""
        host = self.hosts[rank]
        if not host.local:
            return await read_remote(self.ssh_command, host, path)
        try:
            return Path(path).read_text()
        except OSError:
            return None

    def model(self, rank: int, leader_model: str | None, leader_path: str) -> str | None:
        """What ``rank`` should load: its host's own path when the hostfile names one; on this host, the folder
        the leader resolved; elsewhere what ``--model`` said (that host resolves and converts it itself)."""
        host = self.hosts[rank]
        if host.model:
            return host.model
        return leader_path if host.local else leader_model

    def log_format(self, rank: int, leader_format: str) -> str:
        """JSON lines for a remote worker (the leader relays them); the leader's own format on this host."""
        return leader_format if self.hosts[rank].local else "json"

    def cpus(self, rank: int, reported: list[int] | None = None) -> list[int]:
        """The cores ``rank`` pins itself to, with as many BLAS threads; empty: no pinning.

        An entry's own ``cpus`` are its rank's. Otherwise the ranks of one host split its cores (those it
        reported, else this process's own) in contiguous blocks; a rank alone on its host is not pinned. Why
        pin at all: the ring's socket threads busy-poll, and two ranks floating over shared cores starve each
        other.
        """
        host = self.hosts[rank]
        if host.cpus:
            return list(host.cpus)
        peers = machine_ranks(self.hosts, rank)
        if len(peers) == 1:
            return []
        blocks = cpu.split_cores(reported or cpu.allowed_cores(), len(peers))
        return blocks[peers.index(rank)] if blocks else []


async def _end(process: anyio.abc.Process) -> None:
    """Kill a worker that was never told anything (it holds nothing to save) and reap it."""
    with anyio.CancelScope(shield=True):
        with contextlib.suppress(ProcessLookupError):  # it may have ended by itself meanwhile
            process.kill()
        await process.wait()
