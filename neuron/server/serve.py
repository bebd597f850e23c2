"""``neuron serve``: one event loop runs the HTTP server and the engine; the engine owns the pool.

Why we bind the socket ourselves: a port in use is reported before the model
loads, in our words, and uvicorn never gets to call ``sys.exit`` inside our loop.

Why we own the signals: uvicorn's handlers would wait forever for open streams
and re-raise SIGTERM. Here the first SIGTERM or SIGINT stops admission, lets
the running and queued requests finish (up to ``drain_timeout`` s), fails what is left
with an error event, stops the workers, and exits 0. A second signal skips the
wait. The HTTP port answers from the start: ``/health`` at once, ``/ready``
and the API with 503 until the model is loaded and probed.

Under ``neuron.socket``, systemd holds the listening socket across restarts,
and connections wait in its backlog while no process serves. So a process
started with that socket accepts nothing until its model is ready, and closes
the listener on the first signal: a restart answers every request, late
rather than with a 503. A server that binds its own port answers at once
instead, ``/health`` included, so that a supervisor can watch it load.

Under systemd (``Type=notify``) the server says ``READY=1`` once the model has
answered a probe on every rank, keeps ``STATUS=`` current, and sends
``WATCHDOG=1`` only while the engine's step loop makes progress: a step wedged
for half of ``WatchdogSec`` stops the heartbeat, and systemd restarts us.
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

from neuron import systemd
from neuron.engine.engine import Engine, Limits
from neuron.pool import Deadlines
from neuron.server.app import ServerState, build_app

log = structlog.get_logger("neuron.server")

STATUS_EVERY_S = 1.0


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
    drain_timeout: float = 30.0


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


def _status(options: ServeOptions, state: ServerState, engine: Engine | None) -> str:
    if engine is None:
        return f"{state.status}: {options.model_id} on {options.world_size} rank(s)"
    health = "ready" if engine.health.ready else f"not ready ({engine.health.reason})"
    return (
        f"{health}: {options.model_id} on {options.world_size} rank(s), "
        f"{engine.running} running, {engine.waiting} waiting"
    )


async def _tell_systemd(notifier: systemd.Notifier, options: ServeOptions, state: ServerState) -> None:
    """Keep ``STATUS=`` current and feed the watchdog while the step loop is not wedged."""
    tick = min(STATUS_EVERY_S, notifier.watchdog_s / 4) if notifier.watchdog_s else STATUS_EVERY_S
    last = ""
    while True:
        status = _status(options, state, state.engine)
        if status != last:
            notifier.send(f"STATUS={status}")
            last = status
        # While loading (no engine yet), the start-up timeout is systemd's guard, not the watchdog.
        if notifier.watchdog_s and (state.engine is None or state.engine.busy_for() < notifier.watchdog_s / 2):
            notifier.send("WATCHDOG=1")
        await anyio.sleep(tick)


async def serve(options: ServeOptions) -> None:
    activated = systemd.activated_socket()
    sock = activated or bind(options.host, options.port)
    host, port = sock.getsockname()[:2]
    notifier = systemd.Notifier()
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
    lifetime, helpers, stopping = anyio.CancelScope(), anyio.CancelScope(), anyio.Event()

    async def on_signals() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal received", signal=signal.Signals(signum).name)
                if state.engine is None or stopping.is_set():
                    lifetime.cancel()  # still loading, or a second signal: stop without waiting
                stopping.set()

    async with anyio.create_task_group() as tg:
        if not activated:
            tg.start_soon(server.serve, [sock])

        async def run_helpers() -> None:
            with helpers:
                async with anyio.create_task_group() as helper_tasks:
                    helper_tasks.start_soon(on_signals)
                    if notifier.enabled:
                        helper_tasks.start_soon(_tell_systemd, notifier, options, state)

        tg.start_soon(run_helpers)
        log.info(
            "listening",
            host=host,
            port=port,
            model=options.model_id,
            tp=options.world_size,
            socket="systemd" if activated else "bound",
        )
        try:
            with lifetime:
                async with Engine.open(
                    options.model_path, options.world_size, options.backend, options.deadlines, options.limits
                ) as engine:
                    state.engine = engine
                    if activated:
                        tg.start_soon(server.serve, [sock])
                    notifier.send("READY=1", f"STATUS={_status(options, state, engine)}")
                    log.info("serving", host=host, port=port, model=options.model_id)
                    await stopping.wait()
                    notifier.send("STOPPING=1", f"STATUS=draining {engine.pending} request(s)")
                    for listener in server.servers:
                        listener.close()  # new connections wait for the next instance (see above)
                    log.info("draining", requests=engine.pending, timeout_s=options.drain_timeout)
                    if not await engine.drain(options.drain_timeout):
                        log.warning("drain timed out; failing the requests left", requests=engine.pending)
                        engine.abort("the server is shutting down")
        finally:
            state.engine = None
            state.status = "shutting down"
            notifier.send("STOPPING=1")
            helpers.cancel()
            server.should_exit = True  # uvicorn closes the listener and lets the last responses finish
    notifier.close()
    log.info("stopped")
