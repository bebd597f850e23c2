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

import json
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from neuron import metrics, rpc
from neuron.launch import Launcher, LocalLauncher
from neuron.log import ms_since
from neuron.models import read_config
from neuron.pool.fanout import FanOut, PoolError
from neuron.pool.link import Link, describe_exit
from neuron.pool.rank0 import Rank0Thread
from neuron.rpc import StepPlan
from neuron.sampling_params import Sampled, SamplingParams
from neuron.tp.rank import Loaded, Rank, group_joined
from neuron.tp.shard import check_shardable

log = structlog.get_logger("neuron.pool")

BACKENDS = ("ring", "jaccl", "nccl")


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Seconds the leader waits for a reply before it declares the rank lost.

    Generous by default: they exist to turn a hang into an error, not to judge speed.
    """

    ping: float = 30.0
    init: float = 60.0
    load: float = 900.0
    step: float = 120.0
    control: float = 30.0  # clear_kv_cache, unload
    shutdown: float = 10.0


def _free_loopback_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Pool:
    """``model_path`` over ``world_size`` ranks: rank 0 on a thread here, ranks 1.. as worker processes.

    Use it as an async context manager: entering checks the model can be split
    (before any worker exists), spawns, pings and joins the group; leaving
    shuts every worker down, whatever happened in between.
    """

    def __init__(
        self,
        world_size: int,
        model_path: str | Path,
        backend: str = "ring",
        deadlines: Deadlines | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world size must be at least 1, got {world_size}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.world_size = world_size
        self.model_path = str(Path(model_path).resolve())
        self.backend = backend
        self.deadlines = deadlines or Deadlines()
        self.launcher = launcher or LocalLauncher(world_size)
        self.loaded = False
        self._rank0 = Rank0Thread(world_size, self.launcher.rank0_cpus())
        self._fan_out = FanOut(self._rank0)
        self._scratch = tempfile.TemporaryDirectory(prefix="neuron-pool-")
        self._closing = False

    @property
    def workers(self) -> list[Link]:
        return self._fan_out.workers

    @property
    def broken(self) -> PoolError | None:
        """Why the group can no longer be trusted, or None while it can."""
        return self._fan_out.broken

    async def __aenter__(self) -> Pool:
        check_shardable(read_config(self.model_path), self.world_size)
        try:
            await self.start()
            await self.init_group()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.shutdown()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.shutdown()

    # Spawning and the group.

    async def start(self) -> None:
        """Spawn a worker per rank above 0 and check each answers a ping as the rank it was told."""
        if self.world_size > 1 and group_joined():
            raise RuntimeError(
                "this process already hosted rank 0 of an mx.distributed group, and MLX allows one per "
                "process: run each multi-rank pool in a fresh process"
            )
        started = time.perf_counter()
        for rank in range(1, self.world_size):
            process = await self.launcher.spawn(rank)
            assert process.stdout is not None
            reader = BufferedByteReceiveStream(process.stdout)
            self.workers.append(Link(rank, self.launcher.host(rank), process, reader))
        pongs = await self.ping()
        for worker in self.workers:
            pong = pongs[worker.rank]
            if (pong.rank, pong.world_size, pong.protocol) != (worker.rank, self.world_size, rpc.PROTOCOL_VERSION):
                raise self._fan_out.break_group(
                    "ping",
                    {
                        worker.rank: f"answered as rank {pong.rank} of {pong.world_size}, "
                        f"protocol {pong.protocol}; expected rank {worker.rank} of "
                        f"{self.world_size}, protocol {rpc.PROTOCOL_VERSION}"
                    },
                )
        log.info(
            "workers started", world_size=self.world_size, pids=[w.pid for w in self.workers], ms=ms_since(started)
        )

    def _rank_env(self, rank: int, hostfile: Path) -> dict[str, str]:
        return {"MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(self.world_size), "MLX_HOSTFILE": str(hostfile)}

    async def init_group(self) -> None:
        """Bring up the group, rank 0 joining concurrently, then check an all-reduce of ones sums to N."""
        if self.world_size == 1:
            return
        started = time.perf_counter()
        hostfile = Path(self._scratch.name) / "hostfile.json"
        # Loopback only: the ring's sockets are reachable from this host alone.
        ports = _free_loopback_ports(self.world_size)
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
        replies = await self._fan_out(
            "init",
            lambda rank, id: rpc.Init(id=id, backend=self.backend, env=self._rank_env(rank, hostfile)),
            lambda rank: rank.init_group(self.backend, self._rank_env(0, hostfile)),
            self.deadlines.init,
        )
        sums = {0: replies[0], **{w.rank: replies[w.rank].all_sum for w in self.workers}}
        wrong = {
            r: f"sanity all-reduce gave {s:g}, expected {self.world_size}"
            for r, s in sums.items()
            if s != self.world_size
        }
        if wrong:
            raise self._fan_out.break_group("init", wrong)
        log.info("group ready", backend=self.backend, world_size=self.world_size, ms=ms_since(started))

    # Model operations.

    async def load(self) -> dict[int, Loaded]:
        """Load each rank's shard of the model, all ranks at once."""
        self.loaded = False
        started = time.perf_counter()
        replies = await self._fan_out(
            "load_shard",
            lambda _, id: rpc.LoadShard(id=id, model_path=self.model_path),
            lambda rank: rank.load(self.model_path),
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

    async def step(self, plan: StepPlan, joining: dict[int, SamplingParams]) -> dict[int, Sampled]:
        """One batched step on every rank; returns what rank 0 sampled for each sequence that has logits.

        ``joining`` holds the sampling parameters of the sequences this plan
        starts: rank 0 makes a sampler for each, which lives until the sequence
        leaves. Every worker's fingerprint of its state must equal rank 0's, or
        the step fails as a desync naming the rank (the group stays usable once cleared).
        """
        if not self.loaded:
            # Refused here, not by the ranks: after a load that failed on some ranks
            # only, the ranks that have a model would wait in a collective for those
            # that refuse.
            raise PoolError("generate_step", {0: "no model is loaded on every rank; load one first"}, broken=False)
        rank0_s = 0.0
        samplers = self._rank0.samplers

        def on_rank(rank: Rank) -> tuple[dict[int, Sampled], str]:
            nonlocal rank0_s
            started = time.perf_counter()
            sampled = samplers.step(plan, joining, rank.step(plan) or {})
            rank0_s = time.perf_counter() - started
            return sampled, rank.fingerprint()

        started = time.perf_counter()
        replies = await self._fan_out(
            "generate_step", lambda _, id: rpc.GenerateStep(id=id, plan=plan), on_rank, self.deadlines.step
        )
        metrics.STEP_SECONDS.labels("total").observe(time.perf_counter() - started)
        metrics.STEP_SECONDS.labels("rank0").observe(rank0_s)
        if self.workers:
            metrics.STEP_SECONDS.labels("drain").observe(self._fan_out.last_reply - started)
        sampled, expected = replies[0]
        desynced = {
            r: f"desync: its state digest {reply.fingerprint} differs from rank 0's {expected}"
            for r, reply in replies.items()
            if r != 0 and reply.fingerprint != expected
        }
        if desynced:
            metrics.DESYNCS.inc()
            log.error("desync", op="generate_step", failures=desynced)
            raise PoolError("generate_step", desynced, broken=False)
        return sampled

    async def ping(self) -> dict[int, rpc.Pong]:
        """A round trip to every worker with no MLX work: who each says it is, and the pipes' own cost."""
        return await self._fan_out("ping", lambda _, id: rpc.Ping(id=id), None, self.deadlines.ping)

    async def clear_kv_cache(self) -> None:
        samplers = self._rank0.samplers

        def clear(rank: Rank) -> None:
            rank.clear_kv_cache()
            samplers.clear()

        await self._fan_out("clear_kv_cache", lambda _, id: rpc.ClearKvCache(id=id), clear, self.deadlines.control)
        log.debug("kv cache cleared", ranks=self.world_size)

    async def unload(self) -> None:
        self.loaded = False
        await self._fan_out(
            "unload", lambda _, id: rpc.Unload(id=id), lambda rank: rank.unload(), self.deadlines.control
        )

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
            failure = {worker.rank: f"worker pid {worker.pid} {status}"}
            on_lost(self.broken or self._fan_out.break_group("liveness", failure))

        async with anyio.create_task_group() as tg:
            for worker in self.workers:
                tg.start_soon(wait, worker)
            await anyio.sleep_forever()

    async def shutdown(self) -> None:
        """Ask every worker to leave, reap it, and kill any that has not exited by the deadline."""
        self._closing = True
        workers, self._fan_out.workers = self.workers, []

        async def stop(worker: Link) -> None:
            if self.broken is not None:
                # A broken group's workers may sit in a collective for a lost peer: asking them to leave only waits.
                if worker.process.returncode is None:
                    worker.process.kill()
                await worker.process.wait()
                await worker.process.aclose()
                return
            try:
                request = await worker.send(rpc.Shutdown(id=worker.take_id()), self.deadlines.shutdown)
                await worker.receive(request, self.deadlines.shutdown)
                with anyio.fail_after(self.deadlines.shutdown):
                    await worker.process.wait()
            except Exception as e:  # noqa: BLE001 - any failure here ends in a kill
                if worker.process.returncode is None:
                    log.warning("worker did not leave cleanly; killing it", rank=worker.rank, error=str(e))
                    worker.process.kill()
                    await worker.process.wait()
            finally:
                await worker.process.aclose()

        async with anyio.create_task_group() as tg:
            for worker in workers:
                tg.start_soon(stop, worker)
        # A broken group may hold rank 0 inside a collective forever: do not wait long for it.
        await self._rank0.close(1.0 if self.broken else self.deadlines.shutdown)
        self._scratch.cleanup()
        if workers:
            log.info("workers stopped", world_size=self.world_size)
