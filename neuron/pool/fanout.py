"""The fan-out every pool operation goes through: send to every worker, run rank 0's part, drain every reply.

Why always drain: a reply left unread in a pipe would be read as the answer to
the next request. So the drain waits for exactly one reply from every worker
that was sent a request, even when rank 0 failed, and every failing rank is
reported by number and host.

Why rank 0 stops waiting when a worker is lost mid-step: rank 0 may sit inside
a collective for that peer forever (the ring does not always release it, jaccl
never does), so the leader abandons the wait and breaks the pool instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import structlog

from neuron import rpc
from neuron.log import ms_since
from neuron.pool.link import Link
from neuron.pool.rank0 import Abandoned, Rank0Thread
from neuron.rpc import ErrorKind
from neuron.tp.rank import Rank, RankError

log = structlog.get_logger("neuron.pool")

# Worker errors after which the group is still in step: refused before any collective, or failed after all of them.
IN_STEP = (ErrorKind.BAD_STATE, ErrorKind.LOAD_FAILED)


class PoolError(RuntimeError):
    """An operation failed on one or more ranks; ``failures`` maps each rank to what it said.

    ``broken``: the group can no longer be trusted, and only a fresh process can serve again.
    """

    def __init__(self, op: str, failures: dict[int, str], *, broken: bool) -> None:
        self.op = op
        self.failures = dict(sorted(failures.items()))
        self.broken = broken
        detail = "; ".join(f"rank {r}: {m}" for r, m in self.failures.items())
        advice = " The group is out of step: restart neuron." if broken else ""
        super().__init__(
            f"{op} failed on rank{'s' if len(failures) > 1 else ''} "
            f"{', '.join(map(str, self.failures))}: {detail}.{advice}"
        )


class _RankFailure(Exception):
    """One rank's failure inside a fan-out; ``breaks`` says whether the group can still be trusted."""

    def __init__(self, message: str, *, breaks: bool) -> None:
        super().__init__(message)
        self.breaks = breaks


class FanOut:
    """Runs one operation on every rank at a time; remembers when the group broke."""

    def __init__(self, rank0: Rank0Thread) -> None:
        self.rank0 = rank0
        self.workers: list[Link] = []
        self.broken: PoolError | None = None
        self.last_reply = 0.0  # when the latest worker reply arrived (for the drain timing)
        self._lock = anyio.Lock()
        self._lost = anyio.Event()  # set when a worker is lost mid-operation

    def lose(self) -> None:
        """A worker exited: rank 0 stops waiting inside the operation in flight, if any."""
        self._lost.set()

    def break_group(self, op: str, failures: dict[int, str]) -> PoolError:
        self.broken = PoolError(op, failures, broken=True)
        log.error("pool broken", op=op, failures=failures)
        return self.broken

    async def __call__(
        self,
        op: str,
        make: Callable[[int, int], rpc.Request],
        on_rank0: Callable[[Rank], Any] | None,
        deadline: float,
    ) -> dict[int, Any]:
        """Send ``make(rank, id)`` to every worker, then run ``on_rank0`` while draining every worker; results
        by rank."""
        if self.broken is not None:
            raise self.broken
        async with self._lock:
            results: dict[int, Any] = {}
            failures: dict[int, _RankFailure] = {}
            sent: list[tuple[Link, rpc.Request]] = []
            for worker in self.workers:
                try:
                    sent.append((worker, await worker.send(make(worker.rank, worker.take_id()), deadline)))
                except Exception as e:  # noqa: BLE001 - recorded per rank
                    failures[worker.rank] = await self._worker_failure(worker, op, e)
            started = time.perf_counter()
            log.debug("fan-out", op=op, sent=len(sent), failed=len(failures))
            lost = self._lost = anyio.Event()

            async def run_rank0(fn: Callable[[Rank], Any]) -> None:
                try:
                    results[0] = await self.rank0.call(fn, deadline, abandon=lost)
                    log.debug("rank 0 forward", op=op, ms=ms_since(started))
                except Abandoned as e:
                    failures[0] = _RankFailure(str(e), breaks=True)
                except TimeoutError as e:
                    failures[0] = _RankFailure(f"{op} {e}; rank 0 is stuck (a peer not answering?)", breaks=True)
                except (RankError, ValueError) as e:
                    failures[0] = _RankFailure(f"{type(e).__name__}: {e}", breaks=False)
                except Exception as e:  # noqa: BLE001 - an MLX or collective failure: the group is suspect
                    failures[0] = _RankFailure(f"{type(e).__name__}: {e}", breaks=True)

            async def drain(worker: Link, request: rpc.Request) -> None:
                try:
                    reply = await worker.receive(request, deadline)
                except Exception as e:  # noqa: BLE001 - recorded per rank
                    failures[worker.rank] = await self._worker_failure(worker, op, e)
                    lost.set()
                    return
                self.last_reply = max(self.last_reply, time.perf_counter())
                if isinstance(reply, rpc.Error):
                    failures[worker.rank] = _RankFailure(
                        f"{reply.kind}: {reply.message}", breaks=reply.kind not in IN_STEP
                    )
                else:
                    results[worker.rank] = reply

            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for worker, request in sent:
                        tg.start_soon(drain, worker, request)
                    # Rank 0 is skipped when a send failed: its collectives would wait
                    # for a worker that never got the request.
                    if on_rank0 is not None and not failures:
                        tg.start_soon(run_rank0, on_rank0)
            log.debug("drain", op=op, ms=ms_since(started), errors=len(failures))
            if failures:
                messages = {rank: str(f) for rank, f in failures.items()}
                if any(f.breaks for f in failures.values()):
                    raise self.break_group(op, messages)
                log.warning("operation failed", op=op, failures=messages)
                raise PoolError(op, messages, broken=False)
            return results

    async def _worker_failure(self, worker: Link, op: str, error: Exception) -> _RankFailure:
        """Describe a worker that did not answer properly; every such failure breaks the group."""
        if isinstance(error, TimeoutError):
            return _RankFailure(
                f"no reply to {op} within the deadline (pid {worker.pid} alive but stuck?)", breaks=True
            )
        if isinstance(error, rpc.ProtocolError):
            return _RankFailure(f"protocol violation during {op}: {error.message}", breaks=True)
        status = await worker.exit_status()
        return _RankFailure(f"worker pid {worker.pid} {status} during {op}", breaks=True)
