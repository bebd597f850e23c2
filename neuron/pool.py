"""The leader's pool: rank 0 in this process, one worker subprocess per other rank.

Every operation is a fan-out: send the request to every worker without waiting,
do rank 0's share here, then drain exactly one reply from every worker that was
sent one. The drain happens even when rank 0 failed: a reply left unread in a
pipe would be read as the answer to the next request. Request ids make that
mistake detectable; draining makes it impossible.

Why rank 0 lives in the leader: it samples. The logits never leave the process
that computed them, and the next token reaches the workers inside the next
step's request, so nothing but small JSON crosses a pipe.

Why one dedicated thread for rank 0: MLX streams belong to the thread that
created them, so rank 0's group, weights and KV cache must all be made and
used on one thread, for the life of the pool. A step handed to that thread is
shielded from cancellation: once the workers have a step, rank 0 must do its
part of the collectives too, or the workers wait inside them forever.

A pool is *broken* when its group can no longer be trusted: a worker died, went
silent past a deadline, broke the protocol, or a collective failed. Every later
call then fails at once, naming the cause; recovery is a fresh process.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from neuron import cpu, metrics, rpc
from neuron.log import ms_since
from neuron.rpc import ErrorKind
from neuron.tp.model import check_shardable
from neuron.tp.rank import Loaded, Rank, RankError, group_joined

log = structlog.get_logger("neuron.pool")

T = TypeVar("T")

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


class PoolError(RuntimeError):
    """An operation failed on one or more ranks; ``failures`` maps each rank to what it said."""

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


class PoolBroken(PoolError):
    pass


class _RankFailure(Exception):
    """One rank's failure inside a fan-out; ``breaks`` says whether the group can still be trusted."""

    def __init__(self, message: str, *, breaks: bool) -> None:
        super().__init__(message)
        self.breaks = breaks


class Abandoned(RuntimeError):
    """The leader stopped waiting for rank 0 because a peer it depends on failed."""


class Rank0Thread:
    """The one thread that runs rank 0's MLX work, for the life of the pool."""

    def __init__(self, world_size: int, cpus: list[int] | None) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._cpus = cpus
        self._world_size = world_size
        self.rank: Rank | None = None
        # A daemon: if rank 0 is wedged inside a collective (a peer that never
        # answers), nothing can interrupt it, and it must not keep the process alive.
        self._thread = threading.Thread(target=self._run, name="neuron-rank0", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._cpus:
            cpu.pin(self._cpus)
            cpu.set_blas_threads(len(self._cpus))
        self.rank = Rank(0, self._world_size)
        while (job := self._jobs.get()) is not None:
            job()

    async def call(self, fn: Callable[[Rank], T], deadline: float, abandon: anyio.Event | None = None) -> T:
        """Run ``fn(rank)`` on the rank-0 thread and return its result.

        Shielded: a cancelled caller still waits for the job, so a step is never
        torn. The wait ends early only with an error: ``TimeoutError`` after
        ``deadline`` seconds, or ``Abandoned`` once ``abandon`` is set (a peer
        died, and rank 0 may wait inside a collective for it forever). Either
        way the job itself runs on; nothing can interrupt MLX.
        """
        done = anyio.Event()
        outcome: dict[str, Any] = {}
        token = anyio.lowlevel.current_token()

        def job() -> None:
            try:
                assert self.rank is not None
                outcome["value"] = fn(self.rank)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises
                outcome["error"] = e
            try:
                anyio.from_thread.run_sync(done.set, token=token)
            except RuntimeError:
                pass  # the event loop is gone; nobody is waiting

        self._jobs.put(job)
        with anyio.CancelScope(shield=True), anyio.move_on_after(deadline) as timer:
            async with anyio.create_task_group() as tg:

                async def on_abandon() -> None:
                    if abandon is not None:
                        await abandon.wait()
                        tg.cancel_scope.cancel()

                tg.start_soon(on_abandon)
                await done.wait()
                tg.cancel_scope.cancel()
        if not done.is_set():
            if timer.cancelled_caught:
                raise TimeoutError(f"no result within {deadline:g} s")
            raise Abandoned("abandoned: a peer failed while rank 0 was inside the step")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    async def close(self, deadline: float) -> None:
        """Stop the thread and wait for it to end, so it never races the interpreter's exit.

        A thread wedged in a collective never ends; after ``deadline`` it is left
        behind (it is a daemon).
        """
        self._jobs.put(None)
        await anyio.to_thread.run_sync(self._thread.join, deadline)


@dataclass(slots=True)
class Worker:
    rank: int
    process: anyio.abc.Process
    reader: BufferedByteReceiveStream
    pid: int
    next_id: int = 1

    def take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    async def send(self, request: rpc.Request, deadline: float) -> rpc.Request:
        assert self.process.stdin is not None
        # A worker that stops reading fills the pipe, and the write would block forever.
        with anyio.fail_after(deadline):
            await self.process.stdin.send(rpc.encode(request))
        return request

    async def receive(self, request: rpc.Request, deadline: float) -> rpc.Reply:
        """The reply to ``request``; anything else is a protocol violation."""
        with anyio.fail_after(deadline):
            line = await self.reader.receive_until(b"\n", rpc.MAX_LINE_BYTES)
        reply = rpc.decode_reply(line)
        if reply.id != request.id:
            raise rpc.ProtocolError(
                ErrorKind.INVALID_FIELD,
                f"reply id {reply.id} ({reply.op}) does not answer request id {request.id} ({request.op})",
            )
        if not isinstance(reply, (rpc.EXPECTED_REPLY[type(request)], rpc.Error)):
            raise rpc.ProtocolError(ErrorKind.UNKNOWN_OP, f"{reply.op} does not answer {request.op}")
        return reply

    async def exit_status(self) -> str:
        """How the process ended, for an error message; waits briefly for the kernel to report it."""
        with anyio.move_on_after(2.0):
            await self.process.wait()
        return _describe_exit(self.process.returncode)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "closed its stdout but is still running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


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
    """``world_size`` ranks: rank 0 on a thread here, ranks 1.. as ``neuron --worker`` subprocesses.

    Use it as an async context manager: entering spawns, pings and joins the
    group; leaving shuts every worker down, whatever happened in between.
    """

    def __init__(self, world_size: int, backend: str = "ring", deadlines: Deadlines | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world size must be at least 1, got {world_size}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.world_size = world_size
        self.backend = backend
        self.deadlines = deadlines or Deadlines()
        self.workers: list[Worker] = []
        self.broken: PoolBroken | None = None
        self.model_path: str | None = None
        self._cpus = cpu.plan_cpus(world_size) if cpu.is_linux_cpu_backend() else None
        self._rank0 = Rank0Thread(world_size, self._cpus[0] if self._cpus else None)
        self._scratch = tempfile.TemporaryDirectory(prefix="neuron-pool-")
        self._lock = anyio.Lock()
        self._last_reply = 0.0  # when the latest worker reply arrived (for the drain timing)
        self._lost = anyio.Event()  # set when a worker is lost mid-operation: rank 0 stops waiting for it
        self._closing = False

    async def __aenter__(self) -> Pool:
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

    def _worker_env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        # The workers speak to the leader, not to systemd: only the leader may notify.
        env.pop("NOTIFY_SOCKET", None)
        env["PYTHONUNBUFFERED"] = "1"
        if self._cpus:
            env[cpu.CPUS_ENV] = ",".join(map(str, self._cpus[rank]))
            env["OPENBLAS_NUM_THREADS"] = str(len(self._cpus[rank]))
        return env

    async def start(self) -> None:
        """Spawn a worker per rank above 0 and check each answers a ping as the rank it was told."""
        if self.world_size > 1 and group_joined():
            raise RuntimeError(
                "this process already hosted rank 0 of an mx.distributed group, and MLX allows one per "
                "process: run each multi-rank pool in a fresh process"
            )
        started = time.perf_counter()
        for rank in range(1, self.world_size):
            process = await anyio.open_process(
                [sys.executable, "-m", "neuron", "--worker", "--rank", str(rank), "--world-size", str(self.world_size)],
                stdin=-1,
                stdout=-1,
                stderr=None,  # inherited: an unread stderr pipe would block the worker once full
                env=self._worker_env(rank),
            )
            assert process.stdout is not None
            self.workers.append(Worker(rank, process, BufferedByteReceiveStream(process.stdout), process.pid))
        pongs = await self.ping()
        for worker in self.workers:
            pong = pongs[worker.rank]
            if (pong.rank, pong.world_size, pong.protocol) != (worker.rank, self.world_size, rpc.PROTOCOL_VERSION):
                raise self._break(
                    "ping",
                    {
                        worker.rank: f"answered as rank {pong.rank} of {pong.world_size}, "
                        f"protocol {pong.protocol}; expected rank {worker.rank} of "
                        f"{self.world_size}, protocol {rpc.PROTOCOL_VERSION}"
                    },
                )
        log.info(
            "workers started",
            world_size=self.world_size,
            pids=[w.pid for w in self.workers],
            cpus=self._cpus,
            ms=ms_since(started),
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
            raise self._break("init", wrong)
        log.info(
            "group ready",
            backend=self.backend,
            world_size=self.world_size,
            ms=ms_since(started),
        )

    # Model operations.

    async def load(self, model_path: str | Path) -> dict[int, Loaded]:
        """Load each rank's shard, all ranks at once, after checking the model can be split."""
        path = str(Path(model_path).resolve())
        check_shardable(path, self.world_size)
        self.model_path = None
        started = time.perf_counter()
        replies = await self._fan_out(
            "load_shard",
            lambda _, id: rpc.LoadShard(id=id, model_path=path),
            lambda rank: rank.load(path),
            self.deadlines.load,
        )
        self.model_path = path
        loaded = {
            0: replies[0],
            **{w.rank: Loaded(replies[w.rank].parameters, replies[w.rank].seconds) for w in self.workers},
        }
        log.info(
            "model loaded",
            model=path,
            world_size=self.world_size,
            parameters_per_rank=[loaded[r].parameters for r in sorted(loaded)],
            ms=ms_since(started),
        )
        return loaded

    async def step(self, plan: rpc.StepPlan, on_rank0: Callable[[dict[int, Any]], T]) -> T:
        """One batched step on every rank; ``on_rank0(logits by sequence)`` runs on rank 0's thread.

        ``on_rank0`` is where rank 0 samples: it receives the logits while they are
        still MLX arrays on rank 0's thread, and only its result leaves that thread.
        Every worker's fingerprint of its state must equal rank 0's, or the step
        fails as a desync naming the rank (the group stays usable once cleared).
        """
        if self.model_path is None:
            # Refused here, not by the ranks: after a load that failed on some ranks
            # only, the ranks that have a model would wait in a collective for those
            # that refuse.
            raise PoolError("generate_step", {0: "no model is loaded on every rank; load one first"}, broken=False)
        rank0_s = 0.0

        def on_rank(rank: Rank) -> tuple[T, str]:
            nonlocal rank0_s
            started = time.perf_counter()
            result = on_rank0(rank.step(plan))
            rank0_s = time.perf_counter() - started
            return result, rank.fingerprint()

        started = time.perf_counter()
        replies = await self._fan_out("generate_step", lambda _, id: plan.request(id), on_rank, self.deadlines.step)
        metrics.STEP_SECONDS.labels("total").observe(time.perf_counter() - started)
        metrics.STEP_SECONDS.labels("rank0").observe(rank0_s)
        if self.workers:
            metrics.STEP_SECONDS.labels("drain").observe(self._last_reply - started)
        result, expected = replies[0]
        desynced = {
            r: f"desync: its state digest {reply.fingerprint} differs from rank 0's {expected}"
            for r, reply in replies.items()
            if r != 0 and reply.fingerprint != expected
        }
        if desynced:
            metrics.DESYNCS.inc()
            log.error("desync", op="generate_step", failures=desynced)
            raise PoolError("generate_step", desynced, broken=False)
        return result

    async def ping(self) -> dict[int, rpc.Pong]:
        """A round trip to every worker with no MLX work: who each says it is, and the pipes' own cost."""
        return await self._fan_out("ping", lambda _, id: rpc.Ping(id=id), None, self.deadlines.ping)

    async def clear_kv_cache(self) -> None:
        await self._fan_out(
            "clear_kv_cache",
            lambda _, id: rpc.ClearKvCache(id=id),
            lambda rank: rank.clear_kv_cache(),
            self.deadlines.control,
        )
        log.debug("kv cache cleared", ranks=self.world_size)

    async def unload(self) -> None:
        await self._fan_out(
            "unload", lambda _, id: rpc.Unload(id=id), lambda rank: rank.unload(), self.deadlines.control
        )
        self.model_path = None

    async def watch(self, on_lost: Callable[[PoolBroken], None]) -> None:
        """Wait on every worker process; the moment one exits unasked, break the pool and call ``on_lost``.

        Why a task per process: a worker that dies between steps would otherwise
        be noticed only by the next step, while ``/ready`` still said yes. Runs
        until cancelled.
        """

        async def wait(worker: Worker) -> None:
            await worker.process.wait()
            if self._closing:
                return
            self._lost.set()
            status = _describe_exit(worker.process.returncode)
            log.error("worker lost", rank=worker.rank, pid=worker.pid, status=status)
            on_lost(self.broken or self._break("liveness", {worker.rank: f"worker pid {worker.pid} {status}"}))

        async with anyio.create_task_group() as tg:
            for worker in self.workers:
                tg.start_soon(wait, worker)
            await anyio.sleep_forever()

    async def shutdown(self) -> None:
        """Ask every worker to leave, reap it, and kill any that has not exited by the deadline."""
        self._closing = True
        workers, self.workers = self.workers, []

        async def stop(worker: Worker) -> None:
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

    # The fan-out every operation goes through.

    def _break(self, op: str, failures: dict[int, str]) -> PoolBroken:
        self.broken = PoolBroken(op, failures, broken=True)
        log.error("pool broken", op=op, failures=failures)
        return self.broken

    async def _fan_out(
        self,
        op: str,
        make: Callable[[int, int], rpc.Request],
        on_rank0: Callable[[Rank], Any] | None,
        deadline: float,
    ) -> dict[int, Any]:
        """Send to every worker, then run rank 0's part while draining every worker; results by rank.

        ``make(rank, id)`` builds the request for one worker.
        """
        if self.broken is not None:
            raise self.broken
        async with self._lock:
            results: dict[int, Any] = {}
            failures: dict[int, _RankFailure] = {}
            sent: list[tuple[Worker, rpc.Request]] = []
            for worker in self.workers:
                try:
                    sent.append((worker, await worker.send(make(worker.rank, worker.take_id()), deadline)))
                except Exception as e:  # noqa: BLE001 - recorded per rank
                    failures[worker.rank] = await self._worker_failure(worker, op, e)
            started = time.perf_counter()
            log.debug("fan-out", op=op, sent=len(sent), failed=len(failures))
            # A worker lost mid-step makes rank 0 stop waiting at once: it may
            # sit inside a collective for that peer forever.
            lost = self._lost = anyio.Event()

            async def run_rank0(fn: Callable[[Rank], Any]) -> None:
                try:
                    results[0] = await self._rank0.call(fn, deadline, abandon=lost)
                    log.debug("rank 0 forward", op=op, ms=ms_since(started))
                except Abandoned as e:
                    failures[0] = _RankFailure(str(e), breaks=True)
                except TimeoutError as e:
                    failures[0] = _RankFailure(f"{op} {e}; rank 0 is stuck (a peer not answering?)", breaks=True)
                except (RankError, ValueError) as e:
                    failures[0] = _RankFailure(f"{type(e).__name__}: {e}", breaks=False)
                except Exception as e:  # noqa: BLE001 - an MLX or collective failure: the group is suspect
                    failures[0] = _RankFailure(f"{type(e).__name__}: {e}", breaks=True)

            async def drain(worker: Worker, request: rpc.Request) -> None:
                try:
                    reply = await worker.receive(request, deadline)
                except Exception as e:  # noqa: BLE001 - recorded per rank
                    failures[worker.rank] = await self._worker_failure(worker, op, e)
                    lost.set()
                    return
                self._last_reply = max(self._last_reply, time.perf_counter())
                if isinstance(reply, rpc.Error):
                    breaks = reply.kind not in (ErrorKind.BAD_STATE, ErrorKind.STEP_FAILED, ErrorKind.LOAD_FAILED)
                    failures[worker.rank] = _RankFailure(f"{reply.kind}: {reply.message}", breaks=breaks)
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
                    raise self._break(op, messages)
                log.warning("operation failed", op=op, failures=messages)
                raise PoolError(op, messages, broken=False)
            return results

    async def _worker_failure(self, worker: Worker, op: str, error: Exception) -> _RankFailure:
        """Describe a worker that did not answer properly; every such failure breaks the group."""
        if isinstance(error, TimeoutError):
            return _RankFailure(
                f"no reply to {op} within the deadline (pid {worker.pid} alive but stuck?)", breaks=True
            )
        if isinstance(error, rpc.ProtocolError):
            return _RankFailure(f"protocol violation during {op}: {error.message}", breaks=True)
        status = await worker.exit_status()
        return _RankFailure(f"worker pid {worker.pid} {status} during {op}", breaks=True)
