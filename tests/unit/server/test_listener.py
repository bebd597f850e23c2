"""The leader's HTTP server stops at once when told to, and still lets a response in flight finish
(``listener.HttpServer``); its listener's connections send without waiting for acknowledgements (``listener.bind``).

uvicorn's own loop would notice a stop only at its next tick, and its shutdown would pause before it looked whether
the connections had closed; the leader's ends the loop on ``stop`` and looks every few milliseconds instead.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from neuron.server.connections import bounded
from neuron.server.listener import HttpServer, bind

pytestmark = pytest.mark.anyio


async def get(stream: anyio.abc.ByteStream, path: str) -> None:
    await stream.send(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())


async def read_until(stream: anyio.abc.ByteStream, end: bytes) -> bytes:
    """What the server sends until ``end`` (a response's last bytes), or until it closes the connection."""
    got = b""
    while not got.endswith(end):
        try:
            got += await stream.receive()
        except anyio.EndOfStream:
            break
    return got


async def test_stop_lets_the_response_in_flight_finish_closes_an_idle_connection_and_returns() -> None:
    begun, release = anyio.Event(), anyio.Event()

    async def slow(_: Request) -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            yield b"first"
            begun.set()
            await release.wait()
            yield b"last"

        return StreamingResponse(parts())

    async def quick(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/slow", slow), Route("/quick", quick)])
    sock = bind("127.0.0.1", 0)
    address = sock.getsockname()
    # As the leader configures it: its own protocol, no lifespan; a timeout that an idle connection left open
    # would hold the shutdown for, past this test's deadline.
    config = uvicorn.Config(app, http=bounded(16, 10.0), lifespan="off", log_config=None, timeout_graceful_shutdown=60)
    server = HttpServer(config)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            while not server.started:
                await anyio.sleep(0.01)
            idle = await anyio.connect_tcp(*address)
            await get(idle, "/quick")
            assert (await read_until(idle, b"ok")).startswith(b"HTTP/1.1 200")  # then kept alive, idle
            busy = await anyio.connect_tcp(*address)
            await get(busy, "/slow")
            await begun.wait()
            server.stop()
            with anyio.fail_after(5):  # by the stop, not by the idle timeout (10 s) that would close it anyway
                assert await read_until(idle, b"never sent") == b""
            release.set()
            streamed = await read_until(busy, b"0\r\n\r\n")
    assert b"first" in streamed and b"last" in streamed and streamed.endswith(b"0\r\n\r\n"), streamed
    with pytest.raises(OSError):
        await anyio.connect_tcp(*address)


async def test_a_connection_to_the_leaders_listener_sends_without_waiting_for_acks() -> None:
    """Nagle's algorithm off on every accepted connection (TCP_NODELAY), as asyncio sets it where the listener says
    it is TCP: with it on, a response written head first and body after waited for the client's delayed ACK, about
    40 ms on every request of a kept-alive connection (BENCHMARKS.md, "Kept-alive connections")."""
    accepted: asyncio.Queue[int] = asyncio.Queue()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.put_nowait(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    sock = bind("127.0.0.1", 0)
    server = await asyncio.start_server(handle, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname())
        with anyio.fail_after(10):
            assert await accepted.get() != 0
        writer.close()
