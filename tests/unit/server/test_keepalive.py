"""SSE keep-alives (``neuron.server.keepalive``): a comment after each silent stretch, every event in order, and the
events' own error raised once what came before it is sent."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from neuron.server.keepalive import KEEP_ALIVE, pump

pytestmark = pytest.mark.anyio


async def _events(*script: bytes | float | Exception) -> AsyncIterator[bytes]:
    for item in script:
        if isinstance(item, float):
            await anyio.sleep(item)
        elif isinstance(item, Exception):
            raise item
        else:
            yield item


async def _sent(events: AsyncIterator[bytes], every: float) -> list[bytes]:
    sent: list[bytes] = []

    async def send(data: bytes) -> None:
        sent.append(data)

    await pump(events, send, every)
    return sent


async def test_a_silent_stretch_gets_keep_alives_and_every_event_arrives_in_order() -> None:
    sent = await _sent(_events(b"a", 0.25, b"b", b"c"), every=0.1)
    assert sent[0] == b"a" and b"".join(sent).endswith(b"bc")
    assert 1 <= sent.count(KEEP_ALIVE) <= 3 and b"".join(sent[1:]).replace(KEEP_ALIVE, b"") == b"bc"


async def test_a_busy_stream_gets_none_and_what_is_ready_together_goes_out_in_one_write() -> None:
    assert await _sent(_events(b"a", b"b"), every=10.0) == [b"ab"]


async def test_the_events_error_is_raised_after_what_came_before_it() -> None:
    sent: list[bytes] = []

    async def send(data: bytes) -> None:
        sent.append(data)

    with pytest.raises(RuntimeError, match="bug"):
        await pump(_events(b"a", RuntimeError("bug")), send, 10.0)
    assert sent == [b"a"]
