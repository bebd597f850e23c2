"""The pool: rank 0 on a thread here, one worker process per other rank, and every operation as a fan-out.

Every operation sends the request to every worker without waiting, does rank
0's share here, then drains exactly one reply from every worker that was sent
one (``fanout.py`` says why).

Why rank 0 lives in the leader: it samples. The logits never leave the process
that computed them, and the next token reaches the workers inside the next
step's request, so nothing but small JSON crosses a pipe.

The pool is built in layers: ``ranks.py`` spawns the workers and forms the
group, ``load.py`` loads the model onto every rank, ``recovery.py`` replaces a
lost group, and this module adds the steps, the watch on the workers and
shutdown.

A pool is *broken* when its group can no longer be trusted: a worker died, went
silent past a deadline, broke the protocol, or a collective failed. Every later
call then fails at once, naming the cause, until ``recover`` replaces every
worker and rank 0's group in this process (where MLX can forget a group:
``rank.dist.backends``); where it cannot, recovery is a fresh process.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.abc
import structlog

from neuron import metrics, rpc
from neuron.launch.checks import Unreachable
from neuron.launch.ssh import StderrRelay
from neuron.launch.stages import check_split
from neuron.models import architectures
from neuron.models.folder import read_config, text_config
from neuron.pool.fanout import PoolError
from neuron.pool.link import Link
from neuron.pool.replacement import Recovering, tunnel_lost
from neuron.rank.model.share import check_splittable
from neuron.rank.rank import Rank
from neuron.rank.run import Stepped, run
from neuron.sampling_params import Sampled
from neuron.step import DraftRow, Step

log = structlog.get_logger("neuron.pool")


class Pool(Recovering):
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

    def keep_loop_off_rank0(self, off: bool) -> None:
        """Keep the event loop's thread off rank 0's core, or let it float again (``Rank0Thread.keep_loop_off``)."""
        self._rank0.keep_loop_off(off)

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
        head = self._rank0.head
        plan = step.plan
        gauge = self._memory
        read: list[rpc.Memory | None] = [None]

        def on_rank(rank: Rank) -> Stepped:
            stepped = run(rank, step, head)
            read[0] = gauge.fresh(lambda: (rank.held.nbytes(), rank.peak))  # on rank 0's thread, as a worker's
            return stepped

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
        self._read_memory(read[0], replies)
        return mine.sampled

    async def draft(self, rows: list[DraftRow]) -> dict[int, list[int]]:
        """The draft model's tokens for ``rows``, proposed on rank 0's thread (``rank.head.drafter``), which keeps their
        distributions for the step that verifies them: call it right before that step."""
        head = self._rank0.head
        try:
            return await self._rank0.call(lambda _: head.propose(rows), self.deadlines.step)
        except Exception as e:  # any reason is the operator's to read, as a failed step's
            raise PoolError("draft", {0: f"{type(e).__name__}: {e}"}, broken=False, hosts=self.hosts) from e

    async def clear_kv_cache(self, prefixes: bool = True) -> None:
        """Drop every sequence on every rank; with ``prefixes``, every prefix-cache entry too."""
        head = self._rank0.head

        def clear(rank: Rank) -> None:
            rank.clear_kv_cache(prefixes)
            head.clear()

        await self._fan_out(
            "clear_kv_cache", lambda _, id: rpc.ClearKvCache(id=id, prefixes=prefixes), clear, self.deadlines.control
        )
        log.debug("kv cache cleared", ranks=self.world_size, prefixes=prefixes)

    async def open_prefix_disk(self, folder: str, budget: int, stamp: str) -> dict[int, dict[str, int]]:
        """Have every rank spill prefix-cache entries to ``folder`` (``rpc.OpenPrefixDisk``); returns, per rank,
        the files there it may load: key -> tokens."""
        opened = await self._fan_out(
            "open_prefix_disk",
            lambda _, id: rpc.OpenPrefixDisk(id=id, folder=folder, budget=budget, stamp=stamp),
            lambda rank: rpc.PrefixDiskOpened(id=0, saved=rank.open_disk(folder, budget, stamp)),
            self.deadlines.load,
        )
        return {rank: reply.saved for rank, reply in opened.items()}

    async def load_prefixes(self, entries: dict[str, int], drop: list[int] | None = None) -> set[str]:
        """Every rank drops the entries ``drop`` names where it holds them, then loads the files ``entries`` names
        (key -> entry id); returns the keys some rank could not load."""
        dropped = drop or []
        loaded = await self._fan_out(
            "load_prefixes",
            lambda _, id: rpc.LoadPrefixes(id=id, entries=entries, drop=dropped),
            lambda rank: rpc.PrefixesLoaded(id=0, failed=rank.held.entries.load(entries, dropped)),
            self.deadlines.load,
        )
        return {key for reply in loaded.values() for key in reply.failed}

    async def flush_prefix_disk(self) -> bool:
        """Wait for every rank's spilled entries to be written; True if all were in time."""
        flushed = await self._fan_out(
            "flush_prefix_disk",
            lambda _, id: rpc.FlushPrefixDisk(id=id),
            lambda rank: rpc.PrefixDiskFlushed(id=0, written=rank.flush_disk(rpc.FLUSH_S)),
            self.deadlines.control,
        )
        return all(reply.written for reply in flushed.values())

    async def watch(self, on_lost: Callable[[PoolError], None]) -> None:
        """Wait on every worker process, and on every SSH tunnel connection of ``--data-plane ssh``; the moment
        one exits unasked, break the pool and call ``on_lost``.

        Why a task per process: a worker that dies between steps would otherwise
        be noticed only by the next step, while ``/ready`` still said yes; and a
        dead tunnel only when a step's deadline fired. Runs until cancelled,
        following the workers and tunnels each ``recover`` starts.
        """

        def current(worker: Link) -> bool:
            return not self._closing and any(w is worker for w in self._fan_out.workers)

        async def wait(worker: Link) -> None:
            await worker.process.wait()
            if not current(worker):
                return  # asked to leave: at shutdown, or replaced by a recovery
            self._fan_out.lose()
            log.error("worker lost", rank=worker.rank, host=worker.host, pid=worker.pid, status=worker.status())
            if self.broken is None:  # say why (an OOM kill is read from its host), unless a step said it first
                why = await worker.exit_status()
                if self._closing:
                    return
                if self.broken is None:
                    self._fan_out.break_group("liveness", {worker.rank: why})
            assert self.broken is not None
            on_lost(self.broken)

        async def wait_tunnel(host: str, process: anyio.abc.Process, relay: StderrRelay) -> None:
            await process.wait()
            if self._closing or not self._tunnels.forget(process):
                return  # closed: at shutdown, or with the group it carried (``recover`` says if it was lost)
            self._fan_out.lose()
            rank = self.hosts.index(host)
            why = tunnel_lost(rank, host, process, relay)
            broken = self.broken or self._fan_out.break_group("liveness", {rank: why})
            for worker in self._fan_out.workers:  # their links are gone: no step may wait for their replies
                if worker.host == host and worker.process.returncode is None:
                    worker.process.kill()
            on_lost(broken)

        while True:
            renewed = self._renewed = anyio.Event()
            async with anyio.create_task_group() as tg:
                for worker in self.workers:
                    tg.start_soon(wait, worker)
                for host, process, relay in self._tunnels.connections():
                    tg.start_soon(wait_tunnel, host, process, relay)
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
        if workers:
            log.info("workers stopped", world_size=self.world_size)
