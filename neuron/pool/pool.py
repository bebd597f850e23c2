"""The pool: rank 0 on a thread here, one worker process per other rank, and every operation as a fan-out.

Every operation sends the request to every worker without waiting, does rank
0's share here, then drains exactly one reply from every worker that was sent
one (``fanout.py`` says why).

Why rank 0 lives in the leader: it samples. The logits never leave the process
that computed them, and the next token reaches the workers inside the next
step's request, so nothing but small JSON crosses a pipe.

A pool is *broken* when its group can no longer be trusted: a worker died, went
silent past a deadline, broke the protocol, or a collective failed. Every later
call then fails at once, naming the cause; recovery is a fresh process.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from neuron import cpu, metrics, rpc
from neuron.launch.checks import Unreachable, check_gpus, check_handshake, check_models
from neuron.launch.dataplane import spawn_env
from neuron.launch.hosts import describe_host
from neuron.launch.launcher import Launcher
from neuron.launch.stages import check_split, plan_stages
from neuron.launch.tunnels import Tunnels
from neuron.log import ms_since
from neuron.models import digest_files, kv_bytes_per_token, read_config, text_config
from neuron.pool.fanout import Deadlines, FanOut, PoolError
from neuron.pool.group import form_group
from neuron.pool.link import Link, describe_exit
from neuron.pool.rank0 import Rank0Thread
from neuron.sampling_params import Sampled
from neuron.step import Step
from neuron.tp.rank import Loaded, Rank, group_joined, lead
from neuron.tp.shard import check_splittable

log = structlog.get_logger("neuron.pool")

BACKENDS = ("ring", "jaccl", "nccl")


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the ranks run, how they talk, and how the model is split over them."""

    launcher: Launcher
    backend: str = "ring"
    stages: int = 1  # pipeline stages, one per rank; 1: every rank holds a slice of every layer
    split: tuple[int, ...] = ()  # layers per stage, as asked; empty: by each rank's free memory

    @classmethod
    def local(cls, world_size: int, stages: int = 1, split: tuple[int, ...] = ()) -> Layout:
        return cls(Launcher.local(world_size), "ring", stages, split)


class Pool:
    """``model_path`` over the ranks of ``layout``: rank 0 on a thread here, ranks 1.. as worker processes.

    Use it as an async context manager: entering checks the model can be split
    (before any worker exists), spawns, pings and joins the group; leaving
    shuts every worker down, whatever happened in between.
    """

    def __init__(
        self,
        model_path: str | Path,
        layout: Layout | None = None,
        deadlines: Deadlines | None = None,
        model: str | None = None,
    ) -> None:
        self.layout = layout or Layout.local(1)
        if self.layout.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.layout.backend!r}; choose one of {', '.join(BACKENDS)}")
        self.launcher = self.layout.launcher
        self.world_size = world_size = self.launcher.world_size
        self.backend = self.layout.backend
        self.model_path = str(Path(model_path).resolve())
        self.model = model  # what --model said: a host of its own resolves it there
        self.layers: list[tuple[int, int]] = []  # each rank's [first, end) once loaded in stages
        self.deadlines = deadlines or Deadlines()
        self.hosts = [self.launcher.host(rank) for rank in range(world_size)]
        self.loaded = False
        cpus = self.launcher.cpus(0) if cpu.is_linux_cpu_backend() else []
        self._rank0 = Rank0Thread(world_size, cpus or None)
        self._fan_out = FanOut(self._rank0, self.hosts)
        self._scratch = tempfile.TemporaryDirectory(prefix="neuron-pool-")
        self._tunnels = Tunnels(self.launcher, Path(self._scratch.name))  # --data-plane ssh's connections
        self._closing = False
        self._free_memory: list[int] = []  # each rank's host, as its handshake said

    @property
    def workers(self) -> tuple[Link, ...]:
        """The workers' links, by rank; the fan-out owns the list."""
        return tuple(self._fan_out.workers)

    @property
    def broken(self) -> PoolError | None:
        """Why the group can no longer be trusted, or None while it can."""
        return self._fan_out.broken

    async def __aenter__(self) -> Pool:
        config = read_config(self.model_path)
        check_splittable(config, self.world_size, self.layout.stages)
        if self.layout.split:
            check_split(list(self.layout.split), int(text_config(config)["num_hidden_layers"]), self.layout.stages)
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
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.shutdown()

    # Spawning and the group.

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
            spawned = await self.launcher.spawn(rank, env)
            assert spawned.process.stdout is not None
            reader = BufferedByteReceiveStream(spawned.process.stdout)
            self._fan_out.workers.append(Link(rank, self.hosts[rank], spawned.process, reader, spawned.last_words))
        pongs = await self.ping()
        mine = describe_host(0)
        check_handshake(pongs, mine, self.world_size, self.hosts)
        infos = [mine, *(pongs[r].host for r in range(1, self.world_size))]
        check_gpus(self.backend, infos, self.launcher.hosts, leader_visible)
        self._free_memory = [info.free_memory for info in infos]
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
            await form_group(
                self._fan_out,
                self.launcher,
                self.backend,
                pongs,
                self.deadlines,
                Path(self._scratch.name),
                self._tunnels,
            )

    # Model operations.

    async def load(self) -> dict[int, Loaded]:
        """Check every host holds the same model, then load each rank's shard of it, all ranks at once."""
        self.loaded = False
        started = time.perf_counter()
        checked = await self._fan_out(
            "check_model",
            lambda rank, id: rpc.CheckModel(id=id, model=self.launcher.model(rank, self.model, self.model_path)),
            lambda _: rpc.ModelChecked(id=0, path=self.model_path, files=digest_files(self.model_path)),
            self.deadlines.load,
        )
        check_models(checked, self.hosts)
        layers = self._stage_layers()
        replies = await self._fan_out(
            "load_shard",
            lambda rank, id: rpc.LoadShard(id=id, model_path=checked[rank].path, layers=layers[rank]),
            lambda rank: rank.load(self.model_path, layers[0]),
            self.deadlines.load,
        )
        self.loaded = True
        loaded = {
            0: replies[0],
            **{w.rank: Loaded(replies[w.rank].parameters, replies[w.rank].seconds) for w in self.workers},
        }
        log.info(
            "model loaded",
            model=self.model_path,
            world_size=self.world_size,
            parameters_per_rank=[loaded[r].parameters for r in sorted(loaded)],
            ms=ms_since(started),
        )
        return loaded

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token of KV cache costs the rank holding the largest share, computed here so that no rank
        measures anything (the prefix cache's budget must hold on all of them alike)."""
        return kv_bytes_per_token(self.model_path, self.layers, self.world_size)

    def _stage_layers(self) -> list[list[int]]:
        """Each rank's ``[first, end)`` of layers in a pipeline; empty lists (every layer, sliced) otherwise."""
        if self.layout.stages == 1:
            return [[] for _ in range(self.world_size)]
        self.layers = plan_stages(self.model_path, list(self.layout.split), self._free_memory, self.hosts)
        return [list(r) for r in self.layers]

    async def step(self, step: Step) -> dict[int, Sampled]:
        """One batched step on every rank; returns what rank 0 sampled for each sequence that has logits.

        Every rank runs ``step.plan``; rank 0's sampler also reads ``step.starts``.
        Every worker's fingerprint of its state must equal rank 0's, or the step
        fails as a desync naming the rank (the group stays usable once cleared).
        """
        if not self.loaded:
            # Refused here, not by the ranks: after a load that failed on some ranks
            # only, the ranks that have a model would wait in a collective for those
            # that refuse.
            raise PoolError(
                "generate_step", {0: "no model is loaded on every rank; load one first"}, broken=False, hosts=self.hosts
            )
        samplers = self._rank0.samplers
        plan = step.plan

        def on_rank(rank: Rank) -> tuple[dict[int, Sampled], str, bool]:
            return lead(rank, samplers, step)

        replies = await self._fan_out(
            "generate_step", lambda _, id: rpc.GenerateStep(id=id, plan=plan), on_rank, self.deadlines.step
        )
        timing = self._fan_out.timing
        metrics.STEP_SECONDS.labels("total").observe(timing.total)
        metrics.STEP_SECONDS.labels("rank0").observe(timing.rank0)
        if self.workers:
            metrics.STEP_SECONDS.labels("fanout").observe(timing.fan_out)
            metrics.STEP_SECONDS.labels("drain").observe(timing.drain)
        sampled, expected, queued = replies[0]
        if queued:
            metrics.STEPS_AHEAD.inc()
        desynced = {
            r: f"desync: its state digest {reply.fingerprint} differs from rank 0's {expected}"
            for r, reply in replies.items()
            if r != 0 and reply.fingerprint != expected
        }
        if desynced:
            metrics.DESYNCS.inc()
            log.error("desync", op="generate_step", failures=desynced)
            raise PoolError("generate_step", desynced, broken=False, hosts=self.hosts)
        return sampled

    async def ping(self) -> dict[int, rpc.Pong]:
        """A round trip to every worker with no MLX work: who each says it is, and the pipes' own cost."""
        return await self._fan_out("ping", lambda _, id: rpc.Ping(id=id), None, self.deadlines.ping)

    async def clear_kv_cache(self, prefixes: bool = True) -> None:
        """Drop every sequence on every rank; with ``prefixes``, every prefix-cache entry too."""
        samplers = self._rank0.samplers

        def clear(rank: Rank) -> None:
            rank.clear_kv_cache(prefixes)
            samplers.clear()

        await self._fan_out(
            "clear_kv_cache", lambda _, id: rpc.ClearKvCache(id=id, prefixes=prefixes), clear, self.deadlines.control
        )
        log.debug("kv cache cleared", ranks=self.world_size, prefixes=prefixes)

    async def watch(self, on_lost: Callable[[PoolError], None]) -> None:
        """Wait on every worker process; the moment one exits unasked, break the pool and call ``on_lost``.

        Why a task per process: a worker that dies between steps would otherwise
        be noticed only by the next step, while ``/ready`` still said yes. Runs
        until cancelled.
        """

        async def wait(worker: Link) -> None:
            await worker.process.wait()
            if self._closing:
                return
            self._fan_out.lose()
            status = describe_exit(worker.process.returncode)
            log.error("worker lost", rank=worker.rank, host=worker.host, pid=worker.pid, status=status)
            failure = {worker.rank: worker.describe(status)}
            on_lost(self.broken or self._fan_out.break_group("liveness", failure))

        async with anyio.create_task_group() as tg:
            for worker in self.workers:
                tg.start_soon(wait, worker)
            await anyio.sleep_forever()

    async def shutdown(self) -> None:
        """Ask every worker to leave, reap it, and kill any that has not exited by the deadline."""
        self._closing = True
        workers, self._fan_out.workers = self._fan_out.workers, []

        async with anyio.create_task_group() as tg:
            for worker in workers:
                tg.start_soon(worker.stop, self.deadlines.shutdown, self.broken is not None)
        # A broken group may hold rank 0 inside a collective forever: do not wait long for it.
        await self._rank0.close(1.0 if self.broken else self.deadlines.shutdown)
        await self._tunnels.close()
        self._scratch.cleanup()
        if workers:
            log.info("workers stopped", world_size=self.world_size)
