"""Recovery: replacing a lost group in this process, with the ranks (``ranks.py``) and the model loaded onto them
again (``loading.py``).

Every worker is stopped, rank 0 leaves the group and MLX forgets it (``rank.dist.backends``), then fresh workers
start, a fresh group forms on fresh data-plane ports, and the model loads again on every rank. A rank-0 thread that
stays inside the lost group's collective is left behind, within bounds; past them (or where MLX cannot forget a
group) only a fresh leader process can serve again: ``Unrecoverable``.
"""

from __future__ import annotations

import time

import anyio
import anyio.abc
import structlog

from neuron import metrics
from neuron.launch.checks import size
from neuron.launch.dataplane import Sink, cut
from neuron.launch.hosts import describe_host
from neuron.launch.stages import weights_per_rank
from neuron.log import ms_since
from neuron.pool.fanout import PoolError
from neuron.pool.loading import Loader
from neuron.pool.rank0 import Rank0Thread
from neuron.pool.ranks import Ranks
from neuron.pool.watch import tunnel_lost
from neuron.rank.dist import backends, group
from neuron.rank.dist.backends import NoClearBackends

log = structlog.get_logger("neuron.pool")

# Seconds rank 0 gets to leave a lost group once its connections are cut, before its thread is left behind
# (``_abandon_rank0`` below): the ring fails a transfer on a dead socket after ten tries in a row, within milliseconds.
LEAVE_S = 5.0
# Wedged rank-0 threads left behind, each holding its share of the weights, before the leader restarts instead (it
# also does once the host's available memory is under twice rank 0's share).
MAX_ABANDONED = 4


class Unrecoverable(RuntimeError):
    """The lost group cannot be replaced in this process: only a fresh leader process can serve again."""


class Replacement:
    """Replaces every rank of a lost group, and loads the model onto them again.

    Why it keeps the rank-0 threads it left behind: each holds its share of the
    weights for good, so their count, and the memory left, bound how often a
    group can be replaced in this process; past that, ``unrecoverable`` says why.
    """

    def __init__(self, ranks: Ranks, loader: Loader) -> None:
        self._ranks = ranks
        self._loader = loader
        self._abandoned: list[Rank0Thread] = []  # rank-0 threads left wedged inside a lost group
        self.unrecoverable: str | None = None  # why the lost group could not be replaced in this process

    async def recover(self) -> None:
        """Replace a lost group in this process: stop every worker, have rank 0 leave the group and forget it, then
        start fresh workers, form a fresh group on fresh data-plane ports, and load the model again on every rank
        (mlx-lm's sharded layers hold the group they were made with). ``Unrecoverable`` when this MLX cannot
        forget a group, or too many wedged rank-0 threads are left behind; any other error from starting,
        joining or loading as those raise it."""
        ranks = self._ranks
        started = time.perf_counter()
        # First, before any worker is killed (a dead peer's sockets fail rank 0's, and that can wedge it: ``Sink``),
        # rank 0's ends of the lost group's connections are handed to a stand-in that lets every collective queued
        # on them complete; then whatever is left is shut down.
        sink = Sink()
        sunk = sink.replace(ranks.addresses)
        old, ranks.fan_out.workers = ranks.fan_out.workers, []
        async with anyio.create_task_group() as tg:
            for worker in old:
                tg.start_soon(worker.stop, ranks.deadlines.shutdown, True)  # killed: each may sit in a collective
        # Its forwards were the lost group's links; the next group gets its own. One that had ended by itself is
        # said here where a step broke the group before the watch saw it end.
        for host, process, relay in await ranks.tunnels.close():
            if host in ranks.hosts:  # not a host the group went on without (``Ranks.shrink``)
                tunnel_lost(ranks.hosts.index(host), host, process, relay)
        shut = cut(ranks.addresses)
        log.info("data plane cut", sunk=sunk, shut=shut, addresses=ranks.addresses)
        try:
            await ranks.rank0.call(lambda rank: rank.leave_group(), LEAVE_S)
        except TimeoutError:
            await self._abandon_rank0()
        except NoClearBackends as e:
            self.unrecoverable = str(e)
            raise Unrecoverable(str(e)) from e
        finally:
            sink.close()
        self._loader.forget()
        ranks.fan_out.renew()
        log.info("group left", world_size=ranks.world_size, backend=ranks.backend, ms=ms_since(started))
        pongs = await ranks.start()
        try:
            await ranks.init_group(pongs)
        except PoolError as e:
            if 0 in e.failures and any(t.alive for t in self._abandoned):
                # MLX's scheduler counts every stream's queued operations, the wedged one's too, and past a few it
                # has every evaluation wait for one to finish: a fresh thread can wait behind the wedged one.
                self.unrecoverable = f"rank 0 could not join a fresh group beside a thread left wedged in MLX ({e})"
                raise Unrecoverable(self.unrecoverable) from e
            raise
        await self._loader.load()

    async def _abandon_rank0(self) -> None:
        """Rank 0's thread did not come out of the lost group: leave it behind, and go on with a fresh one.

        Why it can stay in forever, whatever is cut: the ring gives each socket a
        thread that fails the transfers pending on it once the peer is gone, and
        then ends; a collective queued after that (the step run ahead, built before
        the loss was known) waits on a socket no thread serves any more, and no
        socket operation of ours can reach it. Its MLX stream belongs to its thread
        (per-thread since MLX 0.31.2), so a fresh thread gets a fresh stream; the
        old one keeps its share of the weights, so only ``MAX_ABANDONED`` may be
        left before the leader restarts to free them."""
        ranks = self._ranks
        wedged = [t for t in self._abandoned if t.alive]
        share = weights_per_rank(self._loader.model_path, ranks.world_size, self._loader.layers)[0]
        free = describe_host(0).free_memory
        if len(wedged) >= MAX_ABANDONED or free < 2 * share:
            self.unrecoverable = (
                f"rank 0 is still inside a collective of the lost {ranks.backend} group {LEAVE_S:g} s after every "
                f"worker was stopped and its connections were cut, and {len(wedged)} such thread(s), each holding "
                f"its share of the weights ({size(share)}), were already left behind ({size(free)} available)"
            )
            raise Unrecoverable(self.unrecoverable)
        old = ranks.rank0
        old.abandon()
        backends.stream_left_wedged()
        self._abandoned = [*wedged, old]
        metrics.RANK0_ABANDONED.inc()
        log.warning(
            "rank 0's thread left behind",
            reason=f"still inside a collective of the lost group {LEAVE_S:g} s after its connections were cut",
            left_behind=len(self._abandoned),
            stuck_in=old.where(),
        )
        fresh = ranks.replace_rank0()
        try:  # MLX forgets the group from here (its cache is the process's), without waiting on the old stream
            await fresh.call(lambda _: group.leave(), LEAVE_S)
            await fresh.call(lambda _: backends.evaluates(), LEAVE_S)
        except NoClearBackends as e:
            self.unrecoverable = str(e)
            raise Unrecoverable(str(e)) from e
        except TimeoutError as e:  # at once, rather than after a group that could never form
            self.unrecoverable = (
                f"rank 0's fresh thread could not evaluate within {LEAVE_S:g} s beside the one left inside the lost "
                f"{ranks.backend} group: MLX's scheduler keeps it waiting behind the wedged thread's queued work"
            )
            raise Unrecoverable(self.unrecoverable) from e
