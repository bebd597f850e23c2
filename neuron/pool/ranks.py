"""The pool's ranks: rank 0 on a thread here, one worker process per other rank, and the group they form.

``Ranks`` spawns the workers, checks each answers as the rank it was told,
brings up the group, and shuts it all down again. It holds the fan-out every
operation goes through, and what the ranks said of themselves (their hosts,
their memory). Loading the model onto them is ``loading.py``'s, replacing a
lost group ``replacement.py``'s, and the pool (``pool.py``) holds them all.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass

import anyio
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from neuron import metrics, rpc
from neuron.config.settings import default
from neuron.launch.checks import Crowded, Unreachable, check_gpus, check_handshake, crowded
from neuron.launch.dataplane import spawn_env
from neuron.launch.hosts import Host, MemoryGauge, describe_host
from neuron.launch.launcher import Launcher
from neuron.launch.tunnels import Tunnels
from neuron.log import ms_since
from neuron.models import hub
from neuron.pool.fanout import Deadlines, FanOut, PoolError
from neuron.pool.form import form_group
from neuron.pool.link import Link
from neuron.pool.rank0 import Rank0Thread
from neuron.rank.dist.group import group_joined
from neuron.rank.rank import Rank
from neuron.system import cpu

log = structlog.get_logger("neuron.pool")

BACKENDS = ("ring", "jaccl", "nccl")


def check_backend(backend: str) -> None:
    """Refused before anything is resolved or started, as a setting that could never form a group."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the ranks run, how they talk, and how the model is split over them."""

    launcher: Launcher
    backend: str = default("backend")
    stages: int = 1  # pipeline stages, one per rank; 1: every rank holds a slice of every layer
    split: tuple[int, ...] = ()  # layers per stage, as asked; empty: by each rank's free memory
    push: bool = False  # send a host that lacks the model the share its ranks load (--push-model)
    spares: tuple[Host, ...] = ()  # hosts that take a rank's place when its own stays out of reach (``spares.py``)
    spare_timeout: float = default("spare_timeout")  # how long it may, first
    hostfile: str | None = None  # where the hosts and spares are written back as they change (``roster.py``)

    @classmethod
    def local(cls, world_size: int, stages: int = 1, split: tuple[int, ...] = ()) -> Layout:
        return cls(Launcher.local(world_size), "ring", stages, split)


class Ranks:
    """The ranks of ``layout``: rank 0 on a thread here, ranks 1.. as worker processes.

    Why the fan-out is here: it holds rank 0's thread and the workers' links,
    which are the ranks; every other part of the pool reaches them through it.
    ``model`` (what ``--model`` said) only shapes a remote worker's environment.
    """

    def __init__(self, layout: Layout, deadlines: Deadlines, model: str | None) -> None:
        self.layout = layout
        self.launcher = layout.launcher
        self.world_size = world_size = self.launcher.world_size
        self.backend = layout.backend
        self.deadlines = deadlines
        self.model = model
        self.hosts = [self.launcher.host(rank) for rank in range(world_size)]
        self.fan_out = FanOut(self._thread(), self.hosts)
        self.tunnels = Tunnels(self.launcher)  # --data-plane ssh's connections
        self.closing = False  # set by ``shutdown``: a worker or tunnel that exits now was asked to
        self._hosts_said: list[rpc.HostInfo] = []  # by rank, from each handshake (rank 0's: this process's)
        self.crowded: list[Crowded] = []  # the machines whose ranks outnumber their cores, as the last start found
        self.memory: dict[int, rpc.Memory] = {}  # each rank's latest reading since its handshake, from the steps
        self.gauge = MemoryGauge()  # rank 0's, read as a worker reads its own
        self.addresses: list[list[str]] = []  # each rank's data-plane addresses in the group, once formed

    def _thread(self) -> Rank0Thread:
        cpus = self.launcher.cpus(0) if cpu.is_linux_cpu_backend() else []
        return Rank0Thread(self.world_size, cpus or None)

    @property
    def rank0(self) -> Rank0Thread:
        """Rank 0's thread; the fan-out owns it, as it owns the workers' links."""
        return self.fan_out.rank0

    def replace_rank0(self) -> Rank0Thread:
        """A fresh thread for rank 0, where its last is left wedged in a lost group (``Replacement``); every later
        operation runs rank 0's part on it."""
        self.fan_out.rank0 = self._thread()
        return self.fan_out.rank0

    async def shrink(self, lost: list[int], layout: Layout) -> None:
        """Drop ``lost`` ranks (their hosts out of reach or drained, no spare left) between steps, over ``layout``
        (their stages re-planned over the hosts that remain): each rank above them moves down past them, and rank 0
        gets a fresh thread, with its own ``Rank`` and pinning for the smaller group. The next start forms the group
        over the hosts that remain."""
        for rank in sorted(lost, reverse=True):
            del self.launcher.hosts[rank]
            del self.hosts[rank]  # the list the fan-out and the pool name hosts from
        # The ranks above a lost one are numbered anew: the next start names each, as the next load its stages.
        metrics.RANKS.clear()
        metrics.STAGE_LAYERS.clear()
        self.world_size = self.launcher.world_size
        self.layout = layout
        self.memory = {}
        old, self.fan_out.rank0 = self.fan_out.rank0, self._thread()
        # Out of the group it was in, if it still is (a drained host's, at a step boundary), so that MLX forgets it.
        # A lost group's rank 0 has left already (``Replacement``), or was left behind there for a fresh thread.
        with contextlib.suppress(TimeoutError):
            await old.call(lambda rank: rank.leave_group(), self.deadlines.control)
        await old.close(self.deadlines.shutdown)

    def place(self, rank: int, host: Host) -> None:
        """Put ``host`` in ``rank``'s place (a spare taking a lost host's, while no worker runs): the next start
        spawns the rank there, and every error, log line and metric names it."""
        old = self.hosts[rank]
        self.launcher.hosts[rank] = host
        self.hosts[rank] = host.ssh  # the list the fan-out and the pool name hosts from
        with contextlib.suppress(KeyError):
            metrics.RANKS.remove(str(rank), old)
        with contextlib.suppress(KeyError):
            metrics.STAGE_LAYERS.remove(str(rank), old)

    @property
    def workers(self) -> tuple[Link, ...]:
        """The workers' links, by rank; the fan-out owns the list."""
        return tuple(self.fan_out.workers)

    async def read_memory(self, limits: dict[int, tuple[int, int]] | None = None) -> dict[int, rpc.Memory]:
        """Every rank's memory read now (``rpc.ReadMemory``), kept as the steps' readings are; by rank. ``limits``:
        by rank, the bytes MLX may hold in all and the freed buffers it may keep, set first where MLX enforces
        them."""
        gauge = self.gauge
        limit = (limits or {}).get

        def mine(rank: Rank) -> rpc.Memory:
            if (mlx := limit(0)) is not None:
                rank.limit_memory(*mlx)
            return gauge.read(lambda: (rank.held.nbytes(), rank.peak))

        def request(rank: int, id: int) -> rpc.ReadMemory:
            memory_limit, cache_limit = limit(rank) or (0, 0)
            return rpc.ReadMemory(id=id, memory_limit=memory_limit, cache_limit=cache_limit)

        replies = await self.fan_out("read_memory", request, mine, self.deadlines.control)
        self.memory = {rank: reply if rank == 0 else reply.memory for rank, reply in replies.items()}
        return dict(self.memory)

    @property
    def said(self) -> tuple[rpc.HostInfo, ...]:
        """What each rank said about its host in its last handshake, by rank (its free memory then)."""
        return tuple(self._hosts_said)

    @property
    def broken(self) -> PoolError | None:
        """Why the group can no longer be trusted, or None while it can."""
        return self.fan_out.broken

    # Spawning and the group.

    async def open(self) -> None:
        """Start the workers and form the group. Whatever fails, every rank is shut down first, so that no worker
        outlives a pool that never opened; a remote rank that failed is named as a host out of reach."""
        try:
            pongs = await self.start()
            await self.init_group(pongs)
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await self.shutdown()
            if isinstance(e, PoolError) and self.launcher.remote:
                # Before the group forms, a remote rank that fails is a host out of reach: the caller retries.
                failing = list(dict.fromkeys(self.hosts[r] for r in e.failures if not self.launcher.hosts[r].local))
                if failing:
                    raise Unreachable(f"cannot reach {', '.join(failing)}: {e}", failing) from e
            raise

    async def start(self) -> dict[int, rpc.Pong]:
        """Spawn a worker per rank above 0 (with nccl, each given its GPU as it starts); each must answer a ping as
        the rank it was told, with our versions, and its host must have a GPU per rank placed there."""
        if self.world_size > 1 and group_joined():
            raise RuntimeError(
                "this process already hosted rank 0 of an mx.distributed group, and MLX allows one per "
                "process: run each multi-rank pool in a fresh process"
            )
        started = time.perf_counter()
        leader_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        for rank in range(1, self.world_size):
            env = spawn_env(self.backend, rank, self.launcher.hosts, leader_visible)
            if not self.launcher.hosts[rank].local:
                env.update(hub.host_env(self.model, self.layout.push))
            spawned = await self.launcher.spawn(rank, env)
            assert spawned.process.stdout is not None
            reader = BufferedByteReceiveStream(spawned.process.stdout)
            read_file = functools.partial(self.launcher.read_file, rank)
            link = Link(
                rank,
                self.hosts[rank],
                spawned.process,
                reader,
                spawned.last_words,
                read_file=read_file,
                over_ssh=spawned.relay is not None,
            )
            self.fan_out.workers.append(link)
        pongs = await self.ping()
        mine = describe_host(0)
        check_handshake(pongs, mine, self.world_size, self.hosts)
        infos = [mine, *(pongs[r].host for r in range(1, self.world_size))]
        check_gpus(self.backend, infos, self.launcher.hosts, leader_visible)
        self.crowded = crowded(self.backend, infos, self.launcher.hosts)
        for machine in self.crowded:
            log.warning("ranks outnumber cores", **machine.describe())
        self._hosts_said = infos
        self.memory = {}
        for worker in self.workers:
            worker.said = infos[worker.rank]
        for rank, host in enumerate(self.hosts):
            metrics.RANKS.labels(str(rank), host).set(1)
        log.info(
            "workers started",
            world_size=self.world_size,
            hosts=self.hosts,
            pids=[w.pid for w in self.workers],
            ms=ms_since(started),
        )
        return pongs

    async def init_group(self, pongs: dict[int, rpc.Pong]) -> None:
        """Check every data-plane link answers, then bring up the group (``group.py``)."""
        if self.world_size > 1:
            self.addresses = await form_group(
                self.fan_out,
                self.launcher,
                self.backend,
                pongs,
                self.deadlines,
                self.tunnels,
            )

    async def ping(self) -> dict[int, rpc.Pong]:
        """A round trip to every worker with no MLX work: who each says it is, and the pipes' own cost."""
        return await self.fan_out("ping", lambda _, id: rpc.Ping(id=id), None, self.deadlines.ping)

    async def shutdown(self) -> None:
        """Ask every worker to leave, reap it, and kill any that has not exited by the deadline."""
        self.closing = True
        workers, self.fan_out.workers = self.fan_out.workers, []

        async with anyio.create_task_group() as tg:
            for worker in workers:
                tg.start_soon(worker.stop, self.deadlines.shutdown, self.broken is not None)
        # A broken group may hold rank 0 inside a collective forever: do not wait long for it.
        await self.rank0.close(1.0 if self.broken else self.deadlines.shutdown)
        await self.tunnels.close()
        if workers:
            log.info("workers stopped", world_size=self.world_size)
