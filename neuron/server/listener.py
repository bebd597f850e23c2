"""How a server listens: its socket bound in our words, the connections its descriptors allow, and uvicorn's
server made quick to stop and deaf to signals (the process that runs it owns them). No MLX: a single model's leader
(``cli.serve``) and a router of several (``router.run``) listen the same way.
"""

from __future__ import annotations

import contextlib
import resource
import socket
from collections.abc import Iterator

import anyio
import structlog
import uvicorn
from starlette.types import ASGIApp

from neuron.config.settings import HttpLimits
from neuron.server.connections import bounded

log = structlog.get_logger("neuron.server")


class ListenError(RuntimeError):
    """The socket cannot be bound; the message says which address and what to pass instead."""


# Descriptors kept for everything but client connections: the listener, workers' pipes, model files, the journal.
RESERVED_DESCRIPTORS = 128


def connection_limit(wanted: int) -> int:
    """``wanted``, or fewer when the descriptor limit could not hold that many: accept() must never run out."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = max(1, soft - RESERVED_DESCRIPTORS)
    if wanted > room:
        log.warning(
            "max_connections lowered to fit the descriptor limit; raise LimitNOFILE= (ulimit -n) for more",
            max_connections=room,
            asked=wanted,
            descriptor_limit=soft,
        )
    return min(wanted, room)


# How often a stopping server looks whether its last connections have closed.
CLOSED_POLL_S = 0.005


class HttpServer(uvicorn.Server):
    """uvicorn's server, less its signal handlers, and quick to stop. uvicorn's own loop looks at ``should_exit``
    every tenth of a second, and its shutdown pauses a tenth before it looks, again every tenth, whether the
    connections have closed: every stop or restart of a leader waited out those tenths. ``stop`` ends the loop at
    once, and the shutdown, uvicorn's otherwise, looks every few milliseconds."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._ticking = anyio.CancelScope()

    @classmethod
    def listening(cls, app: ASGIApp, http: HttpLimits) -> HttpServer:
        """A server of ``app`` with the connections ``http`` allows (``server.connections``)."""
        config = uvicorn.Config(
            app,
            http=bounded(connection_limit(http.max_connections), http.header_timeout),
            ws="none",
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_keep_alive=http.keep_alive_timeout,  # type: ignore[arg-type]  # a float works: call_later takes it
            timeout_graceful_shutdown=5,
        )
        return cls(config)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # neuron handles SIGTERM and SIGINT itself (see the module's docstring)

    async def main_loop(self) -> None:
        with self._ticking:
            await super().main_loop()

    def stop(self) -> None:
        """Close the listener and let the last responses finish (within ``timeout_graceful_shutdown``), now."""
        self.should_exit = True
        self._ticking.cancel()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # an idle connection closes now, a busy one once its response is sent
        with anyio.move_on_after(self.config.timeout_graceful_shutdown):
            while self.server_state.connections or self.server_state.tasks:
                await anyio.sleep(CLOSED_POLL_S)
        if self.server_state.tasks:
            log.warning("responses cut short: the graceful shutdown timed out", tasks=len(self.server_state.tasks))
        for task in self.server_state.tasks:
            task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        for server in self.servers:
            await server.wait_closed()
        await self.lifespan.shutdown()


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # The protocol named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections whose
    # socket says IPPROTO_TCP, and accepted ones take the listener's. With Nagle on, a response written in two parts
    # (head, then body) waited for the client's delayed ACK: about 40 ms on every request of a kept-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror}; pass another --port or --host") from e
    return sock
