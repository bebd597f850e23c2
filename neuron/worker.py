"""The worker: one rank above 0, serving the leader's requests over stdin/stdout.

A plain synchronous loop on the main thread, because a rank's MLX state must
stay on the thread that made it. Between steps the worker waits on its
blocking stdin, never inside a collective: a rank spinning in a collective for
a late peer burns most of a core.

Its stdout carries the protocol and nothing else. At start it keeps a private
handle on the real stdout and points fd 1 at stderr, so a stray ``print`` from
any library lands in the logs instead of corrupting the stream.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import BinaryIO

import structlog

from neuron import cpu, rpc
from neuron import log as logging_setup
from neuron.rpc import ErrorKind

_PARENT_POLL_S = 1.0


def _take_stdout() -> BinaryIO:
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol_out


def _exit_with_parent() -> None:
    """Exit if the leader dies while this rank is stuck where stdin EOF cannot reach it.

    A worker waiting on stdin sees EOF the moment the leader dies. One blocked
    inside a collective does not (jaccl never reports a lost peer), so a
    daemon thread watches for re-parenting instead.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(70)

    threading.Thread(target=watch, name="neuron-parent-watch", daemon=True).start()


def read_line(stream: BinaryIO) -> bytes | None:
    """The next line, or None at EOF; an over-long line is consumed and reported as a ProtocolError."""
    line = stream.readline(rpc.MAX_LINE_BYTES + 1)
    if not line:
        return None
    if len(line) > rpc.MAX_LINE_BYTES:
        # Discard the rest of the line so the next read starts at a fresh request.
        size = len(line)
        while line and not line.endswith(b"\n"):
            line = stream.readline(1 << 16)
            size += len(line)
        raise rpc.ProtocolError(
            ErrorKind.LINE_TOO_LONG, f"request line of {size} bytes exceeds the cap of {rpc.MAX_LINE_BYTES}"
        )
    return line


def run_worker(rank: int, world_size: int) -> int:
    """Serve the leader's requests until it says shutdown or goes away; the exit status."""
    protocol_out = _take_stdout()
    _exit_with_parent()
    cpus = cpu.parse_cpus(os.environ.get(cpu.CPUS_ENV, ""))
    if cpus:
        cpu.pin(cpus)  # before MLX starts any thread, so its threads inherit the mask
    logging_setup.configure(
        os.environ.get("NEURON_LOG_LEVEL", "info"), os.environ.get("NEURON_LOG_FORMAT", "auto"), rank=rank
    )
    log = structlog.get_logger("neuron.worker")

    from neuron.tp.rank import Rank, RankError  # MLX loads here, after pinning

    if cpus:
        cpu.set_blas_threads(len(cpus))
    log.info("worker started", pid=os.getpid(), world_size=world_size, cpus=cpus, blas=cpu.blas_in_use())
    state = Rank(rank, world_size)

    def handle(request: rpc.Request) -> rpc.Reply:
        match request:
            case rpc.Ping(id=id):
                return rpc.Pong(id=id, rank=rank, world_size=world_size, protocol=rpc.PROTOCOL_VERSION, pid=os.getpid())
            case rpc.Init(id=id, backend=backend, env=env):
                return rpc.InitOk(id=id, all_sum=state.init_group(backend, env))
            case rpc.LoadShard(id=id, model_path=path):
                loaded = state.load(path)
                log.info("shard loaded", model=path, parameters=loaded.parameters, seconds=round(loaded.seconds, 2))
                return rpc.LoadShardOk(id=id, parameters=loaded.parameters, seconds=loaded.seconds)
            case rpc.GenerateStep(id=id, plan=plan):
                state.step(plan)
                return rpc.GenerateStepOk(id=id, fingerprint=state.fingerprint())
            case rpc.ClearKvCache(id=id):
                state.clear_kv_cache()
                return rpc.KvCacheCleared(id=id)
            case rpc.Unload(id=id):
                state.unload()
                return rpc.Unloaded(id=id)
            case rpc.Shutdown(id=id):
                return rpc.Bye(id=id)
        raise AssertionError(f"unhandled request {request!r}")

    def failure_kind(request: rpc.Request, error: Exception) -> ErrorKind:
        if isinstance(request, rpc.Init):
            return ErrorKind.INIT_FAILED
        if isinstance(request, rpc.LoadShard):
            return ErrorKind.LOAD_FAILED
        if isinstance(error, RankError):
            return ErrorKind.BAD_STATE
        if isinstance(request, rpc.GenerateStep):
            return ErrorKind.GROUP_FAILED
        return ErrorKind.INTERNAL

    stdin = sys.stdin.buffer
    while True:
        request: rpc.Request | None = None
        try:
            line = read_line(stdin)
            if line is None:
                log.info("stdin closed; the leader is gone, exiting")
                return 0
            request = rpc.decode_request(line)
            reply = handle(request)
        except rpc.ProtocolError as e:
            log.warning("bad request", kind=e.kind.value, error=e.message)
            reply = rpc.Error(id=e.request_id, kind=e.kind, message=f"rank {rank}: {e.message}")
        except Exception as e:  # noqa: BLE001 - every failure becomes an error reply
            assert request is not None
            kind = failure_kind(request, e)
            log.error("request failed", op=request.op, kind=kind.value, error=str(e))
            message = str(e) if str(e).startswith(f"rank {rank}") else f"rank {rank}: {type(e).__name__}: {e}"
            reply = rpc.Error(id=request.id, kind=kind, message=message)
        try:
            protocol_out.write(rpc.encode(reply))
            protocol_out.flush()
        except BrokenPipeError:
            log.info("stdout closed; the leader is gone, exiting")
            return 0
        if isinstance(request, rpc.Shutdown):
            log.info("shutdown requested; bye")
            return 0
