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
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from neuron import rpc
from neuron.config.settings import default
from neuron.log import debugging, ms_since
from neuron.pool.link import Link
from neuron.pool.rank0 import Abandoned, Alarm, Rank0Thread
from neuron.rank.rank import Rank, RankError
from neuron.rpc import ErrorKind
from neuron.system import device

log = structlog.get_logger("neuron.pool")

# Worker errors after which the group is still in step: refused before any collective, or failed after all of them.
IN_STEP = (ErrorKind.BAD_STATE, ErrorKind.LOAD_FAILED)


class PoolError(RuntimeError):
    """An operation failed on one or more ranks; ``failures`` maps each rank to what it said.

    ``broken``: the group can no longer be trusted; only fresh workers and a fresh group can serve again.
    ``out_of_memory``: a rank failed to allocate (MLX out of memory on its device): the batch resumes smaller.
    """

    def __init__(
        self,
        op: str,
        failures: dict[int, str],
        *,
        broken: bool,
        hosts: list[str] | None = None,
        out_of_memory: bool = False,
    ) -> None:
        self.op = op
        self.out_of_memory = out_of_memory
        # A worker's own messages start with its rank; here every one is named by rank and host instead.
        self.failures = {r: m.removeprefix(f"rank {r}: ") for r, m in sorted(failures.items())}
        self.broken = broken
        where = (lambda r: f"rank {r} on {hosts[r]}") if hosts else (lambda r: f"rank {r}")
        detail = "; ".join(f"{where(r)}: {m}" for r, m in self.failures.items())
        if op == "drain":  # nothing failed: the operator set the group aside (``FanOut.stand_down``)
            super().__init__(f"the group is set aside to move ranks off a drained host: {detail}")
            return
        super().__init__(f"{op} failed: {detail}" + (" (the group is lost)" if broken else ""))


class _RankFailure(Exception):
    """One rank's failure inside a fan-out; ``breaks`` says whether the group can still be trusted."""

    def __init__(self, message: str, *, breaks: bool, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.breaks = breaks
        self.out_of_memory = out_of_memory


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Seconds the leader waits for a reply before it declares the rank lost.

    Generous by default: they exist to turn a hang into an error, not to judge speed.
    """

    ping: float = 30.0
    init: float = 60.0
    load: float = 900.0
    step: float = default("step_timeout")  # --step-timeout
    control: float = 30.0  # clear_kv_cache
    shutdown: float = 10.0


@dataclass(frozen=True, slots=True)
class Timing:
    """Where the latest operation's seconds went."""

    fan_out: float  # writing the request to every worker
    rank0: float  # rank 0's part, from the last write to its result (its share of every collective included)
    drain: float  # after rank 0's result, until the last worker's reply
    total: float
    ranks: dict[int, float] = field(default_factory=dict)  # each rank's, from the last write to its result or reply


class FanOut:
    """Runs one operation on every rank at a time; remembers when the group broke."""

    def __init__(self, rank0: Rank0Thread, hosts: list[str]) -> None:
        self.rank0 = rank0
        self.hosts = hosts  # by rank: every error names the host as well as the rank
        self.workers: list[Link] = []
        self.broken: PoolError | None = None
        self.last_reply = 0.0  # when the latest worker reply arrived (for the drain timing)
        self.timing = Timing(0.0, 0.0, 0.0, 0.0)
        # Taken without yielding to the event loop when free (as it is, but for a recovery racing a step): the
        # step's plan reaches rank 0 before the streams of the step before run.
        self._lock = anyio.Lock(fast_acquire=True)
        self._lost = Alarm()  # set when a worker is lost mid-operation
        self._debug = debugging()

    def renew(self) -> None:
        """Trust the group again: a recovery has replaced every worker and rank 0's group."""
        self.broken = None
        self._lost = Alarm()

    def lose(self) -> None:
        """A worker exited: rank 0 stops waiting inside the operation in flight, if any."""
        self._lost.set()

    def stand_down(self, failures: dict[int, str]) -> PoolError:
        """The operator takes ranks out (a drain): the group is replaced as a lost one is, though nothing failed,
        so nothing is logged as an error."""
        self.broken = PoolError("drain", failures, broken=True, hosts=self.hosts)
        return self.broken

    def break_group(self, op: str, failures: dict[int, str], out_of_memory: bool = False) -> PoolError:
        self.broken = PoolError(op, failures, broken=True, hosts=self.hosts, out_of_memory=out_of_memory)
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
            began = time.perf_counter()
            debug = self._debug
            results: dict[int, Any] = {}
            failures: dict[int, _RankFailure] = {}
            sent: list[tuple[Link, rpc.Request]] = []
            for worker in self.workers:
                try:
                    sent.append((worker, await worker.send(make(worker.rank, worker.take_id()), deadline)))
                except Exception as e:  # noqa: BLE001 - recorded per rank
                    failures[worker.rank] = await self._worker_failure(worker, op, e)
            started = rank0_done = self.last_reply = time.perf_counter()
            if debug:
                log.debug("fan-out", op=op, sent=len(sent), failed=len(failures), ms=round((started - began) * 1000, 2))
            lost = self._lost = Alarm()
            replied: dict[int, float] = {}

            async def run_rank0(fn: Callable[[Rank], Any]) -> None:
                nonlocal rank0_done
                try:
                    results[0] = await self.rank0.call(fn, deadline, abandon=lost)
                    rank0_done = time.perf_counter()
                    if debug:
                        log.debug("rank 0 forward", op=op, ms=ms_since(started))
                except Abandoned as e:
                    failures[0] = _RankFailure(str(e), breaks=True)
                except TimeoutError as e:
                    failures[0] = _RankFailure(f"{op} {e}; rank 0 is stuck (a peer not answering?)", breaks=True)
                except (RankError, ValueError) as e:
                    failures[0] = _RankFailure(f"{type(e).__name__}: {e}", breaks=False)
                except Exception as e:  # noqa: BLE001 - an MLX or collective failure: the group is suspect
                    # An allocation that failed leaves a rank alone in step (its caches are cleared next); beside
                    # peers, they may wait inside a collective for it.
                    oom = device.out_of_memory(e)
                    breaks = bool(self.workers) or not oom
                    failures[0] = _RankFailure(f"{type(e).__name__}: {e}", breaks=breaks, out_of_memory=oom)

            async def drain(worker: Link, request: rpc.Request) -> None:
                try:
                    reply = await worker.receive(request, deadline)
                except Exception as e:  # noqa: BLE001 - recorded per rank
                    lost.set()  # first: describing a dead worker may read its host's OOM count, over SSH
                    failures[worker.rank] = await self._worker_failure(worker, op, e)
                    return
                now = time.perf_counter()
                self.last_reply = max(self.last_reply, now)
                replied[worker.rank] = now - started
                if isinstance(reply, rpc.Error):
                    message = reply.message.removeprefix(f"rank {worker.rank}: ")
                    failures[worker.rank] = _RankFailure(
                        f"{reply.kind}: {message}",
                        breaks=reply.kind not in IN_STEP,
                        out_of_memory=reply.kind == ErrorKind.OUT_OF_MEMORY,
                    )
                else:
                    results[worker.rank] = reply

            # Rank 0 is skipped when a send failed: its collectives would wait for a worker that never got the
            # request. Its job is queued before anything yields (``Rank0Thread.call``).
            rank0 = on_rank0 if not failures else None
            with anyio.CancelScope(shield=True):
                if not sent:
                    if rank0 is not None:
                        await run_rank0(rank0)
                else:
                    async with anyio.create_task_group() as tg:
                        for worker, request in sent:
                            tg.start_soon(drain, worker, request)
                        if rank0 is not None:
                            await run_rank0(rank0)
            if debug:
                log.debug("drain", op=op, ms=ms_since(started), errors=len(failures))
            ended = time.perf_counter()
            drained = max(0.0, self.last_reply - rank0_done) if sent else 0.0
            replied[0] = rank0_done - started
            self.timing = Timing(started - began, rank0_done - started, drained, ended - began, replied)
            if failures:
                messages = {rank: str(f) for rank, f in failures.items()}
                oom = any(f.out_of_memory for f in failures.values())
                if any(f.breaks for f in failures.values()):
                    raise self.break_group(op, messages, out_of_memory=oom)
                log.warning("operation failed", op=op, failures=messages)
                raise PoolError(op, messages, broken=False, hosts=self.hosts, out_of_memory=oom)
            return results

    async def _worker_failure(self, worker: Link, op: str, error: Exception) -> _RankFailure:
        """Describe a worker that did not answer properly; every such failure breaks the group."""
        if isinstance(error, TimeoutError):
            return _RankFailure(
                f"no reply to {op} within the deadline (pid {worker.pid} alive but stuck?)", breaks=True
            )
        if isinstance(error, rpc.ProtocolError):
            return _RankFailure(f"protocol violation during {op}: {error.message}", breaks=True)
        return _RankFailure(f"{await worker.exit_status()} during {op}", breaks=True)
