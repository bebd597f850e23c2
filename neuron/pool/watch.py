"""The watch on the ranks: a task per worker process and per SSH tunnel connection, so that one that exits unasked
breaks the pool the moment it does.

Why a task per process: a worker that dies between steps would otherwise be
noticed only by the next step, while ``/ready`` still said yes; and a dead
tunnel only when a step's deadline fired.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.abc
import structlog

from neuron.launch.ssh import StderrRelay
from neuron.pool.fanout import PoolError
from neuron.pool.link import Link, describe_exit
from neuron.pool.ranks import Ranks

log = structlog.get_logger("neuron.pool")


class Watch:
    """Waits on every worker process of ``ranks``, and on every SSH tunnel connection of ``--data-plane ssh``.

    Why it is told when the ranks are replaced (``follow``): a recovery starts
    fresh workers and tunnels, and the tasks waiting on the old ones must give
    way to tasks waiting on those.
    """

    def __init__(self, ranks: Ranks) -> None:
        self._ranks = ranks
        self._renewed = anyio.Event()  # set when ``Pool.recover`` has replaced the workers: the watch follows them

    def follow(self) -> None:
        """Watch the workers and tunnels a recovery has just started, in place of those it replaced."""
        self._renewed.set()

    async def run(self, on_lost: Callable[[PoolError], None]) -> None:
        """The moment a worker or tunnel exits unasked, break the pool and call ``on_lost``; runs until cancelled."""
        ranks = self._ranks
        fan_out = ranks.fan_out

        def current(worker: Link) -> bool:
            return not ranks.closing and any(w is worker for w in fan_out.workers)

        async def wait(worker: Link) -> None:
            await worker.process.wait()
            if not current(worker):
                return  # asked to leave: at shutdown, or replaced by a recovery
            fan_out.lose()
            log.error("worker lost", rank=worker.rank, host=worker.host, pid=worker.pid, status=worker.status())
            if ranks.broken is None:  # say why (an OOM kill is read from its host), unless a step said it first
                why = await worker.exit_status()
                if ranks.closing:
                    return
                if ranks.broken is None:
                    fan_out.break_group("liveness", {worker.rank: why})
            assert ranks.broken is not None
            on_lost(ranks.broken)

        async def wait_tunnel(host: str, process: anyio.abc.Process, relay: StderrRelay) -> None:
            await process.wait()
            if ranks.closing or not ranks.tunnels.forget(process):
                return  # closed: at shutdown, or with the group it carried (``recover`` says if it was lost)
            fan_out.lose()
            rank = ranks.hosts.index(host)
            why = tunnel_lost(rank, host, process, relay)
            broken = ranks.broken or fan_out.break_group("liveness", {rank: why})
            for worker in fan_out.workers:  # their links are gone: no step may wait for their replies
                if worker.host == host and worker.process.returncode is None:
                    worker.process.kill()
            on_lost(broken)

        while True:
            renewed = self._renewed = anyio.Event()
            async with anyio.create_task_group() as tg:
                for worker in ranks.workers:
                    tg.start_soon(wait, worker)
                for host, process, relay in ranks.tunnels.connections():
                    tg.start_soon(wait_tunnel, host, process, relay)
                await renewed.wait()
                tg.cancel_scope.cancel()


def tunnel_lost(rank: int, host: str, process: anyio.abc.Process, relay: StderrRelay) -> str:
    """Log that the data plane's tunnel connection to ``host`` ended by itself; the reason, for the pool's error."""
    said = relay.last_words()
    why = (
        f"the SSH connection carrying the data plane's tunnels to {host} (ssh pid {process.pid}) "
        f"{describe_exit(process.returncode)}" + (f" (ssh: {said})" if said else "")
    )
    log.error("ssh tunnel lost", rank=rank, host=host, pid=process.pid, status=why)
    return why
