"""The pool: rank 0 on a thread here, one worker process per other rank, and every operation as a fan-out.

Every operation sends the request to every worker without waiting, does rank
0's share here, then drains exactly one reply from every worker that was sent
one (``fanout.py`` says why).

Why rank 0 lives in the leader: it samples. The logits never leave the process
that computed them, and the next token reaches the workers inside the next
step's request, so nothing but small JSON crosses a pipe.

The pool is built in layers: ``ranks.py`` spawns the workers and forms the
group, ``load.py`` loads the model onto every rank, and this module adds the
steps, the watch on the workers, recovery and shutdown.

A pool is *broken* when its group can no longer be trusted: a worker died, went
silent past a deadline, broke the protocol, or a collective failed. Every later
call then fails at once, naming the cause, until ``recover`` replaces every
worker and rank 0's group in this process (where MLX can forget a group:
``rank.backends``); where it cannot, recovery is a fresh process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import structlog

from neuron import architectures, metrics, rpc
from neuron.launch.checks import Unreachable
from neuron.launch.dataplane import cut
from neuron.launch.stages import check_split
from neuron.log import ms_since
from neuron.models import read_config, text_config
from neuron.pool.fanout import PoolError
from neuron.pool.link import Link, describe_exit
from neuron.pool.load import Loading
from neuron.rank.backends import NoClearBackends
from neuron.rank.rank import Rank
from neuron.rank.shard import check_splittable
from neuron.rank.step import Stepped, run
from neuron.sampling_params import Sampled
from neuron.step import Step

log = structlog.get_logger("neuron.pool")

# Seconds rank 0 gets to come out of a lost group's collective once its connections are cut: the ring retries a
# failing send or receive a number of times before it gives up, slowly on a loaded host.
LEAVE_S = 30.0


class Unrecoverable(RuntimeError):
    """The lost group cannot be replaced in this process: only a fresh leader process can serve again."""


class Pool(Loading):
    """``model_path`` over the ranks of ``layout``: rank 0 on a thread here, ranks 1.. as worker processes.

    Use it as an async context manager: entering checks the model can be split
    (before any worker exists), spawns, pings and joins the group; leaving
    shuts every worker down, whatever happened in between.
    """

    async def __aenter__(self) -> Pool:
        config = read_config(self.model_path)
        check_splittable(config, self.world_size, self.layout.stages)
        if self.layout.stages > 1:
            layers = int(text_config(config)["num_hidden_layers"])
            check_split(list(self.layout.split), layers, self.layout.stages, architectures.kept_together(config))
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

        def on_rank(rank: Rank) -> Stepped:
            return run(rank, step, samplers)

        replies = await self._fan_out(
            "generate_step", lambda _, id: rpc.GenerateStep(id=id, plan=plan), on_rank, self.deadlines.step
        )
        timing = self._fan_out.timing
        metrics.STEP_SECONDS.labels("total").observe(timing.total)
        metrics.STEP_SECONDS.labels("rank0").observe(timing.rank0)
        if self.workers:
            metrics.STEP_SECONDS.labels("fanout").observe(timing.fan_out)
            metrics.STEP_SECONDS.labels("drain").observe(timing.drain)
        mine = replies[0]
        expected = mine.fingerprint
        if mine.queued:
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
        return mine.sampled

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

    async def recover(self) -> None:
        """Replace a lost group in this process: stop every worker, have rank 0 leave the group and forget it, then
        start fresh workers, form a fresh group on fresh data-plane ports, and load the model again on every rank
        (mlx-lm's sharded layers hold the group they were made with). ``Unrecoverable`` when rank 0 stays inside
        the lost group's collectives, or this MLX cannot forget a group; any other error from starting, joining or
        loading as those raise it."""
        started = time.perf_counter()
        old, self._fan_out.workers = self._fan_out.workers, []
        async with anyio.create_task_group() as tg:
            for worker in old:
                tg.start_soon(worker.stop, self.deadlines.shutdown, True)  # killed: each may sit in a collective
        # A collective lets rank 0 go once its connections end: a worker killed here closes its own, but one
        # stopped, or out of reach, holds them open, so rank 0's end is shut down too. A backend whose collectives
        # wait on other things (jaccl's RDMA) may keep rank 0's thread: then only a fresh process can serve.
        if cut_connections := cut(self._addresses):
            log.info("data plane cut", connections=cut_connections, addresses=self._addresses)
        try:
            await self._rank0.call(lambda rank: rank.leave_group(), LEAVE_S)
        except TimeoutError as e:
            raise Unrecoverable(
                f"rank 0 is still inside a collective of the lost {self.backend} group {LEAVE_S:g} s after every "
                "worker was stopped and its connections were cut"
            ) from e
        except NoClearBackends as e:
            raise Unrecoverable(str(e)) from e
        self.loaded = False
        self._fan_out.renew()
        log.info("group left", world_size=self.world_size, backend=self.backend, ms=ms_since(started))
        pongs = await self.start()
        await self.init_group(pongs)
        await self.load()
        self._renewed.set()
        metrics.WORKER_RESTARTS.inc()

    async def watch(self, on_lost: Callable[[PoolError], None]) -> None:
        """Wait on every worker process; the moment one exits unasked, break the pool and call ``on_lost``.

        Why a task per process: a worker that dies between steps would otherwise
        be noticed only by the next step, while ``/ready`` still said yes. Runs
        until cancelled, following the workers each ``recover`` starts.
        """

        async def wait(worker: Link) -> None:
            await worker.process.wait()
            if self._closing or all(w is not worker for w in self._fan_out.workers):
                return  # asked to leave: at shutdown, or replaced by a recovery
            self._fan_out.lose()
            status = describe_exit(worker.process.returncode)
            log.error("worker lost", rank=worker.rank, host=worker.host, pid=worker.pid, status=status)
            if self.broken is None:  # say why (an OOM kill is read from its host), unless a step said it first
                why = await worker.exit_status()
                if self._closing:
                    return
                if self.broken is None:
                    self._fan_out.break_group("liveness", {worker.rank: why})
            assert self.broken is not None
            on_lost(self.broken)

        while True:
            renewed = self._renewed = anyio.Event()
            async with anyio.create_task_group() as tg:
                for worker in self.workers:
                    tg.start_soon(wait, worker)
                await renewed.wait()
                tg.cancel_scope.cancel()

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
