"""uvicorn's HTTP/1.1 protocol (h11) with bounds on what idle connections may hold. No MLX.

uvicorn times a connection out only between requests (``timeout_keep_alive``):
one that connects and sends nothing, or half a request line, holds its
descriptor forever, and a few thousand of them used to exhaust the process.
Here a request's head must arrive within ``header_timeout`` of its first byte
(or of the connection), and at most ``max_connections`` are open: past that,
a new connection closes the oldest one that is waiting for a request, or, when
every one is busy with a request, is answered 503 and closed. So idle
connections never lock out a client with a request to send.

uvicorn's own ``limit_concurrency`` is not used: it answers 503 to requests
while idle connections keep their places.
"""

from __future__ import annotations

import sys
import time
from http import HTTPStatus
from typing import Any, ClassVar

import h11
import orjson
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger("neuron.server")

LOG_EVERY_S = 1.0  # at most one line a second about connections closed or refused, with the count


def _raw_response(status: int, message: str, code: str, extra: bytes = b"") -> bytes:
    """A whole response, written past h11 on a connection about to close, in OpenAI's error body."""
    kind = "invalid_request_error" if status < 500 or status == HTTPStatus.NOT_IMPLEMENTED else "server_error"
    body = orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
    )
    return head.encode() + extra + b"connection: close\r\n\r\n" + body


def unparsed(error: BaseException | None) -> tuple[int, str, str]:
    """The status, message and code for a request h11 could not parse (``error``, its exception): its status hint
    (431 for a head over its buffer, 501 for a transfer coding it does not take, else 400), and what to change."""
    said = str(error) if error is not None else "unreadable"
    status = getattr(error, "error_status_hint", HTTPStatus.BAD_REQUEST)
    if status == HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
        return (
            status,
            "the request's head (its request line and headers) is too large: send fewer or shorter headers",
            "headers_too_large",
        )
    if status == HTTPStatus.NOT_IMPLEMENTED:
        return (
            status,
            f"{said}: only `Transfer-Encoding: chunked` is taken, given once",
            "unsupported_transfer_encoding",
        )
    return HTTPStatus.BAD_REQUEST, f"the request is not valid HTTP/1.1 ({said})", "invalid_http"


class _Tally:
    """Counts what happened to connections and says so at most once per ``LOG_EVERY_S``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.last = 0.0

    def add(self, what: str, open_connections: int, limit: int) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S:
            log.warning("connection limit reached", open=open_connections, max_connections=limit, **self.counts)
            self.counts, self.last = {}, now


class BoundedH11Protocol(H11Protocol):
    """Set ``max_connections`` and ``header_timeout`` on a subclass (``bounded``); uvicorn makes one per connection.

    The class keeps the count of connections not yet closed by us and, oldest first, those waiting for a
    request, so that a new connection at the limit costs O(1), however many arrive at once.
    """

    max_connections: ClassVar[int]  # set by ``bounded``, from the settings
    header_timeout: ClassVar[float]
    tally = _Tally()
    open_count = 0
    waiting: ClassVar[dict[BoundedH11Protocol, None]] = {}  # insertion-ordered, the oldest first; one per subclass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counted = False  # in open_count
        self.refused = False
        self.partial = False  # some of a request's head has come
        self._head_timer: Any = None

    def waiting_for_request(self) -> bool:
        """No request in flight: before the first request's head has arrived, or idle between requests."""
        if self.refused or self.transport.is_closing():
            return False
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _count(self, counted: bool) -> None:
        if counted != self.counted:
            type(self).open_count += 1 if counted else -1
            self.counted = counted

    def _mark(self) -> None:
        """Keep this connection's place among the waiting ones current."""
        if self.waiting_for_request():
            self.waiting.setdefault(self, None)
        else:
            self.waiting.pop(self, None)

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if self.open_count >= self.max_connections:
            victim = next(iter(self.waiting), None)
            if victim is not None:
                del self.waiting[victim]
                victim._count(False)
                victim._disarm()
                victim.transport.close()
                self.tally.add("closed_idle", self.open_count, self.max_connections)
            else:
                self.refused = True
                message = f"the server holds its {self.max_connections} connections; try again shortly"
                refusal = _raw_response(503, message, "too_many_connections", b"retry-after: 1\r\n")
                transport.write(refusal)
                transport.close()
                self.tally.add("refused", self.open_count, self.max_connections)
                return
        self._count(True)
        self._mark()
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        # Still reading a request's head: timed from the connection or the head's first byte. Once it is read,
        # the route's time is its own, and between requests uvicorn's keep-alive timeout holds.
        self._mark()
        if self.waiting_for_request():
            self.partial = True
            self._arm()
        else:
            self.partial = False
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._mark()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._count(False)
        self.waiting.pop(self, None)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, in the JSON error body every other refusal has, not its
        plain text. uvicorn calls it inside its ``except h11.RemoteProtocolError``: the error handled is h11's."""
        status, message, code = unparsed(sys.exc_info()[1])
        self.transport.write(_raw_response(status, message, code))
        self.transport.close()

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.waiting_for_request():
            return
        if self.partial and self.conn.our_state is h11.IDLE:
            message = f"no complete request head within {self.header_timeout:g} s"
            self.transport.write(_raw_response(408, message, "request_timeout"))
        self.transport.close()


def bounded(max_connections: int, header_timeout: float) -> type[BoundedH11Protocol]:
    """The protocol class to hand uvicorn (``Config(http=...)``) with these bounds."""
    return type(
        "BoundedH11Protocol",
        (BoundedH11Protocol,),
        {"max_connections": max_connections, "header_timeout": header_timeout, "waiting": {}, "open_count": 0},
    )
