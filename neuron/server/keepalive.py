"""Server-sent events with keep-alives: an SSE comment whenever a stream has said nothing for a while.

Why: a stream can fall silent for seconds with nothing wrong: a long prompt
being fed, or the ranks being replaced after one was lost while its requests
wait to go on (``engine.resume``). Proxies and clients with read timeouts would
cut it; a comment line (``: keep-alive``) keeps it open, and every SSE client
ignores it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import orjson

KEEP_ALIVE = b": keep-alive\n\n"
KEEP_ALIVE_S = 2.0  # well inside the read timeouts of common proxies (nginx's 60 s) and clients


async def pump(events: AsyncIterator[bytes], send: Callable[[bytes], Awaitable[None]], every: float) -> None:
    """``send`` each of ``events`` as it comes, and ``KEEP_ALIVE`` after each ``every`` s without one; raises
    what ``events`` raised, once what came before it is sent.

    The events are read by a task of their own, so that waiting for the next one is never cancelled midway (an
    async generator cancelled inside its ``anext`` is finished for good)."""
    pending: deque[bytes] = deque()
    failed: list[Exception] = []
    ended = False
    wake = anyio.Event()

    async def read() -> None:
        nonlocal ended
        try:
            async for data in events:
                pending.append(data)
                wake.set()
        except Exception as e:  # noqa: BLE001 - raised again by the sender, after what came before
            failed.append(e)
        ended = True
        wake.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        while True:
            with anyio.move_on_after(every):
                await wake.wait()
            wake = anyio.Event()  # before taking what is pending: an event added from now on sets the new one
            if not pending and not ended:
                await send(KEEP_ALIVE)
            if pending:  # what came while the last write waited for the client goes out as one write
                data = b"".join(pending)
                pending.clear()
                await send(data)
            if ended:
                break
    if failed:
        raise failed[0]


def sse(obj: dict[str, Any]) -> bytes:
    """One unnamed server-sent event holding ``obj`` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"
