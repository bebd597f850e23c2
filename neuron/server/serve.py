"""``neuron serve``: one event loop runs the HTTP server and the engine; the engine owns the pool.

Why we bind the socket ourselves: a port in use is reported before the model
loads, in our words, and uvicorn never gets to call ``sys.exit`` inside our loop.

Why we own the signals: uvicorn's handlers would wait forever for open streams
and re-raise SIGTERM. Here the first SIGTERM or SIGINT stops admission, lets
the running and queued requests finish (up to ``DRAIN_S``), fails what is left
with an error event, stops the workers, and exits 0. A second signal skips the
wait. The HTTP port answers from the start: ``/health`` at once, ``/ready``
and the API with 503 until the model is loaded and probed.
"""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import structlog
import uvicorn

from neuron.engine.engine import Engine, Limits
from neuron.pool import Deadlines
from neuron.server.app import ServerState, build_app

log = structlog.get_logger("neuron.server")

DRAIN_S = 30.0


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model_path: Path
    model_id: str
    world_size: int = 1
    backend: str = "ring"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    deadlines: Deadlines = field(default_factory=Deadlines)
    limits: Limits = field(default_factory=Limits)


class ServeError(RuntimeError):
    pass


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # neuron handles SIGTERM and SIGINT itself (see the module's docstring)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror}; pass another --port or --host") from e
    return sock


async def serve(options: ServeOptions) -> None:
    sock = bind(options.host, options.port)
    host, port = sock.getsockname()[:2]
    state = ServerState(options.model_id, options.api_key)
    config = uvicorn.Config(
        build_app(state),
        http="h11",
        ws="none",
        lifespan="off",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = _Server(config)
    lifetime, signals_watch, stopping = anyio.CancelScope(), anyio.CancelScope(), anyio.Event()

    async def on_signals() -> None:
        with signals_watch, anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal received", signal=signal.Signals(signum).name)
                if state.engine is None or stopping.is_set():
                    lifetime.cancel()  # still loading, or a second signal: stop without waiting
                stopping.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        tg.start_soon(on_signals)
        log.info("listening", host=host, port=port, model=options.model_id, tp=options.world_size)
        try:
            with lifetime:
                async with Engine.open(
                    options.model_path, options.world_size, options.backend, options.deadlines, options.limits
                ) as engine:
                    state.engine = engine
                    log.info("serving", host=host, port=port, model=options.model_id)
                    await stopping.wait()
                    log.info("draining", requests=engine.pending, timeout_s=DRAIN_S)
                    if not await engine.drain(DRAIN_S):
                        log.warning("drain timed out; failing the requests left", requests=engine.pending)
                        engine.abort("the server is shutting down")
        finally:
            state.engine = None
            state.status = "shutting down"
            signals_watch.cancel()
            server.should_exit = True  # uvicorn closes the listener and lets the last responses finish
    log.info("stopped")
