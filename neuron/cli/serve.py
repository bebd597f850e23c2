"""The leader process of ``neuron serve``: one event loop runs the HTTP server and the engine; the engine owns
the pool. Its signals, its readiness for systemd, and its restart when a lost group cannot be replaced in
process live here, beside the CLI: ``neuron.server`` is only the HTTP application.

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

What a lost group does: the requests in flight outlive it. The engine pauses
them, the pool replaces every worker and rank 0's group inside this process
(MLX caches one group per backend per process; ``rank.dist.backends`` makes it forget
the lost one), and each request goes on where it stopped, its connection open
all along (``engine.resume``). This module sees none of it, unless the group
cannot be replaced here: rank 0 held inside a collective, a backend that
cannot let a group go, MLX without ``clear_backends``, no fresh group within
``--resume-timeout`` (or that set to 0). Then the engine's ``lost`` is set,
every request in flight has ended with an error (an SSE error event, or 503
with ``Retry-After``), the listener closes, the workers are stopped, and
``restart_leader`` re-executes this process (same pid, so systemd still sees
its main process) with the listening socket handed over as a socket
activation would. Connections that arrive meanwhile wait in the socket's
backlog; the fresh leader answers them at once, with 503 until its model is
ready again.

Under systemd (``Type=notify``) the server says ``READY=1`` once the model has
answered a probe on every rank, keeps ``STATUS=`` current, and sends
``WATCHDOG=1`` only while the engine's step loop makes progress: a step wedged
for half of ``WatchdogSec`` stops the heartbeat, and systemd restarts us.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NoReturn, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import structlog
import uvicorn

from neuron import log as logging_setup
from neuron import metrics
from neuron.config.settings import HttpLimits, Scheduling, Serving
from neuron.engine.engine import Engine
from neuron.launch.checks import Unreachable
from neuron.launch.hostfile import Hostfile, write_hostfile
from neuron.models.adapters import AdapterError, parse_list
from neuron.pool import Deadlines, Layout
from neuron.pool.roster import log_move
from neuron.pool.spares import Move, Spares
from neuron.server.app import ServerState, build_app
from neuron.server.guard import Allowed, split_list
from neuron.server.http import open_to_others
from neuron.server.keys import load as load_keys
from neuron.server.listener import HttpServer, bind
from neuron.system import systemd
from neuron.system.reexec import reexec
from neuron.tracing import Tracing

log = structlog.get_logger("neuron.server")

STATUS_EVERY_S = 1.0
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model_path: Path | None  # None: ``model`` names a model on the Hub, fetched once the port answers
    model_id: str
    layout: Layout = field(default_factory=lambda: Layout.local(1))
    model: str | None = None  # what --model said: hosts of their own resolve it there
    serving: Serving = field(default_factory=Serving)
    http: HttpLimits = field(default_factory=HttpLimits)
    deadlines: Deadlines = field(default_factory=Deadlines)
    limits: Scheduling = field(default_factory=Scheduling)


RESTART_ENV = "NEURON_RESTART"  # set by restart_leader for the fresh leader: why, when, and how many times


@dataclass(frozen=True, slots=True)
class Recovery:
    """Why the leader restarts, handed from the old process to the fresh one."""

    cause: str
    lost_at: float  # time.time(), so the fresh process can log how long the recovery took
    restarts: int
    # Re-executions of the leader so far, by why (``metrics.LEADER_RESTARTS``' labels), this one included.
    leader_restarts: dict[str, int] = field(default_factory=dict)
    # Since when the hosts out of reach at start have been (time.time()): a rank moves to a spare past
    # --spare-timeout, whatever the restarts between; None where none is out.
    out_since: float | None = None
    rank_moves: int = 0  # ranks moved to spares at start so far (``metrics.RANK_MOVES``)

    def counted(self, why: str, previous: Recovery | None) -> Recovery:
        """This recovery, with ``previous``' counts of leader restarts carried on and this one added."""
        counts = dict(previous.leader_restarts) if previous else {}
        counts[why] = counts.get(why, 0) + 1
        return replace(self, leader_restarts=counts)


@dataclass(frozen=True, slots=True)
class Restart:
    """What ``serve`` returns when the group was lost: the caller passes it to ``restart_leader``."""

    listener_fd: int
    recovery: Recovery


def restart_leader(restart: Restart) -> NoReturn:
    """Replace this process with a fresh leader that inherits the listening socket as file descriptor 3."""
    # First, the real stderr back as descriptor 2 (the pipe's reader does not survive the exec): its saved copy may
    # be descriptor 3, which the listening socket takes next.
    logging_setup.release_native_stderr()
    os.dup2(restart.listener_fd, systemd.LISTEN_FDS_START)  # inheritable, unlike every other descriptor
    note = json.dumps(asdict(restart.recovery))
    reexec({**os.environ, "LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "1", RESTART_ENV: note})


def _restarted() -> Recovery | None:
    note = os.environ.pop(RESTART_ENV, None)
    return Recovery(**json.loads(note)) if note else None


async def _first(*events: anyio.Event) -> None:
    async with anyio.create_task_group() as tg:

        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)


def _status(options: ServeOptions, state: ServerState, engine: Engine | None) -> str:
    launcher = options.layout.launcher
    ranks = f"{options.model_id} on {launcher.world_size} rank(s)"
    if launcher.remote:
        ranks += f" ({', '.join(launcher.host(r) for r in range(launcher.world_size))})"
    if engine is None:
        return f"{state.status}: {ranks}"
    health = "ready" if engine.health.ready else f"not ready ({engine.health.reason})"
    return f"{health}: {ranks}, {engine.running} running, {engine.waiting} waiting"


# Seconds before the leader tries a host out of reach again: soon at first, then no more than every 15 s.
RETRY_S = (1, 2, 4, 8, 15)


def spare_at_start(layout: Layout, error: Unreachable, since: float, now: float) -> list[Move]:
    """At start, hosts out of reach since ``since``: past ``--spare-timeout``, each of their ranks moves to a spare
    (``Spares``), written to the hostfile, which the fresh leader reads. Nothing without spares or a hostfile."""
    if not layout.spares or not layout.hostfile:
        return []
    hosts = layout.launcher.hosts
    spares = Spares(hosts, layout.spares, layout.spare_timeout, clock=lambda: now)
    spares.failed([rank for rank, host in enumerate(hosts) if host.ssh in error.hosts], since=since)
    moves = spares.move(f"out of reach at start for over {layout.spare_timeout:g} s (--spare-timeout): {error}")
    if moves:
        placed = list(hosts)
        for move in moves:
            placed[move.rank] = move.host
            log_move(move)
        try:
            write_hostfile(layout.hostfile, Hostfile(tuple(placed), tuple(spares.spares)))
        except OSError as e:  # the fresh leader reads the hostfile: unwritten, nothing moved
            log.error("hostfile not written: no rank moves to a spare", path=layout.hostfile, error=str(e))
            return []
    return moves


async def _wait_to_retry(
    error: Unreachable,
    restarted: Recovery | None,
    state: ServerState,
    notifier: systemd.Notifier,
    stopping: anyio.Event,
    layout: Layout,
) -> Recovery | None:
    """A host is out of reach: say which, wait, and hand back the ``Recovery`` for a fresh try (None on a signal).
    Past ``--spare-timeout``, its ranks move to spares first (``spare_at_start``), and the try comes at once.

    The retry is a fresh process, as after a lost group: rank 0 may already have
    joined a group, and MLX allows one per process.
    """
    count = restarted.restarts + 1 if restarted else 1
    now = time.time()
    since = restarted.out_since if restarted and restarted.out_since is not None else now
    moves = spare_at_start(layout, error, since, now)
    if moves:
        since = now  # the spare's own bound starts here
    delay = RETRY_S[0] if moves else RETRY_S[min(count, len(RETRY_S)) - 1]
    state.status = f"waiting for {', '.join(error.hosts)} (next try in {delay} s): {error}"
    log.error("host unreachable; trying again", hosts=error.hosts, error=str(error), retry_s=delay, restarts=count)
    notifier.send(f"STATUS={state.status}")
    with anyio.move_on_after(delay):
        await stopping.wait()
    if stopping.is_set():
        return None
    moved = (restarted.rank_moves if restarted else 0) + len(moves)
    lost_at = restarted.lost_at if restarted else now
    return Recovery(str(error), lost_at, count, out_since=since, rank_moves=moved).counted("unreachable", restarted)


def _why_restart(engine: Engine, options: ServeOptions) -> str:
    """Why the group could not be replaced in this process, as ``metrics.LEADER_RESTARTS`` labels it."""
    if engine.pool.unrecoverable is not None:
        return "unrecoverable"
    return "resume_off" if options.limits.resume_timeout <= 0 else "recovery_failed"


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


def _stop_accepting(server: uvicorn.Server) -> None:
    for listener in server.servers:
        listener.close()


async def _drain(engine: Engine, server: uvicorn.Server, notifier: systemd.Notifier, timeout: float) -> None:
    notifier.send("STOPPING=1", f"STATUS=draining {engine.pending} request(s)")
    _stop_accepting(server)  # under neuron.socket, new connections wait for the next instance (see above)
    log.info("draining", requests=engine.pending, timeout_s=timeout)
    if not await engine.drain(timeout):
        log.warning("drain timed out; failing the requests left", requests=engine.pending)
        engine.abort("the server is shutting down")


async def _in_daemon_thread(function: Callable[..., T], *args: object) -> T:
    """``function(*args)`` on a daemon thread of its own, awaited. Why not ``to_thread``: a signal abandons a
    download, which holds no MLX and resumes on the next start, and the process must exit at once rather than
    wait, as the interpreter does for any other thread, for the file to finish."""
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(function(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task, which raises it
            failure.append(e)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            anyio.from_thread.run_sync(done.set, token=token)

    threading.Thread(target=run, name="neuron-fetch", daemon=True).start()
    await done.wait()
    if failure:
        raise failure[0]
    return result[0]


async def _fetch(options: ServeOptions, state: ServerState) -> Path:
    """Fetch the model named on the Hub while the port answers: ``/ready`` says how far the download got."""
    from neuron.models.folder import fetch, resolve
    from neuron.models.progress import Download

    state.download = Download(str(options.model))
    state.status = f"fetching {options.model} from the Hugging Face Hub"
    local = await _in_daemon_thread(fetch, options.model, state.download)
    state.status = "loading the model"
    state.download = None
    return resolve(str(local))  # a GGUF file is converted here, on this thread as before the port opened


def _adapters(options: ServeOptions) -> list[tuple[str, str]]:
    """``--adapter``'s pairs (name, folder or Hub name); a name the base model goes by is refused."""
    pairs = parse_list(options.serving.adapter)
    if clash := next((name for name, _ in pairs if name == options.model_id), None):
        raise AdapterError(f"--adapter {clash}: the base model is served as {clash!r}; give the adapter another name")
    return pairs


async def run_leader(options: ServeOptions) -> Restart | None:
    """Serve until a signal (returns None) or until the group is lost (returns a ``Restart``)."""
    restarted = _restarted()
    if restarted:
        metrics.WORKER_RESTARTS.inc(restarted.restarts)
        metrics.RANK_MOVES.labels("unreachable").inc(restarted.rank_moves)
        for why, count in restarted.leader_restarts.items():
            metrics.LEADER_RESTARTS.labels(why).inc(count)
    activated = systemd.activated_socket()
    sock = activated or bind(options.serving.host, options.serving.port)
    host, port = sock.getsockname()[:2]
    notifier = systemd.Notifier()
    endpoint = options.serving.otlp_traces_endpoint
    tracing = Tracing(endpoint, options.serving.trace_step_ratio) if endpoint else None
    keys = load_keys(options.serving.api_key, options.serving.api_keys_file)
    state = ServerState(options.model_id, keys, tracing=tracing)
    http = options.http
    allowed = Allowed.build(
        split_list(http.allowed_origins), split_list(http.allowed_hosts), listen=options.serving.host
    )
    server = HttpServer.listening(build_app(state, allowed, with_page=not http.no_page), http)
    lifetime, helpers, stopping = anyio.CancelScope(), anyio.CancelScope(), anyio.Event()

    async def on_signals() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal received", signal=signal.Signals(signum).name)
                if state.engine is None or stopping.is_set():
                    lifetime.cancel()  # still loading, or a second signal: stop without waiting
                stopping.set()

    async with anyio.create_task_group() as tg:
        if not activated or restarted:
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
            ranks=options.layout.launcher.world_size,
            socket="inherited" if restarted else "systemd" if activated else "bound",
        )
        if (keys_file := options.serving.api_keys_file) and os.stat(keys_file).st_mode & 0o077:
            log.warning(
                "keys file readable by others",
                path=keys_file,
                fix=f"chmod 600 {keys_file} (its owner: the user neuron runs as)",
            )
        if open_to_others(host, state.keys):
            log.warning(
                "open to the network",
                host=host,
                port=port,
                open="every client that reaches this address may generate with the model (/v1, the page) and "
                "read /metrics; the admin routes still answer loopback clients only",
                fix="set an API key (--api-key or $NEURON_API_KEY), or listen on 127.0.0.1 (--host)",
            )
        restart = None
        try:
            with lifetime:
                try:
                    model_path = options.model_path or await _fetch(options, state)
                    engine_context = Engine.open(
                        model_path,
                        options.layout,
                        options.deadlines,
                        options.limits,
                        options.model,
                        _adapters(options),
                    )
                    async with engine_context as engine:
                        state.engine = engine
                        if activated and not restarted:
                            tg.start_soon(server.serve, [sock])
                        notifier.send("READY=1", f"STATUS={_status(options, state, engine)}")
                        log.info("serving", host=host, port=port, model=options.model_id)
                        if restarted:
                            ms = round((time.time() - restarted.lost_at) * 1000)
                            log.info("recovered", cause=restarted.cause, restarts=restarted.restarts, ms=ms)
                        await _first(stopping, engine.lost)
                        if stopping.is_set():
                            await _drain(engine, server, notifier, options.serving.drain_timeout)
                        else:
                            cause = str(engine.pool.broken or engine.health.reason)
                            # In-process recoveries count as restarts with fresh workers too.
                            count = (restarted.restarts if restarted else 0) + engine.recovery.recoveries + 1
                            why = _why_restart(engine, options)
                            log.error("group lost; restarting the leader", cause=cause, why=why, restarts=count)
                            notifier.send("RELOADING=1", f"STATUS=restarting: {cause}")  # READY=1 follows
                            # Kept past uvicorn's close: connections wait in its backlog for the fresh leader.
                            lost = Recovery(cause, time.time(), count).counted(why, restarted)
                            restart = Restart(os.dup(sock.fileno()), lost)
                            _stop_accepting(server)
                except Unreachable as e:
                    waited = await _wait_to_retry(e, restarted, state, notifier, stopping, options.layout)
                    if (recovery := waited) is not None:
                        restart = Restart(os.dup(sock.fileno()), recovery)
                        _stop_accepting(server)
        finally:
            state.engine = None
            state.status = "shutting down"
            if restart is None:
                notifier.send("STOPPING=1")
            helpers.cancel()
            server.stop()  # closes the listener and lets the last responses finish
    notifier.close()
    if tracing is not None:
        tracing.close()  # the spans still batched are exported before the process ends or restarts
    log.info("restarting" if restart else "stopped")
    return restart
