"""The skeleton every route is written on, once: the API key, the body's size and JSON, the engine (or 503 while
it loads), errors in the family's shape, a client that goes away (a 499, or the end of its event stream) and
server-sent events. A family declares its routes as ``Endpoint``s; a handler gets a ``Call`` and returns a
``Response``. No MLX.

A client that goes away never tears a step: the handler only tells the engine (``engine.cancel``), and the
engine drops the request at the next step boundary.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import orjson
import structlog
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from neuron import images, metrics
from neuron.engine.sequence import Sequence
from neuron.server.common import limits
from neuron.server.common.errors import ApiError, not_ready, openai_body, within_limits
from neuron.server.common.fields import Served
from neuron.server.common.generation import Generation
from neuron.server.common.submit import cancel, submit
from neuron.server.guard import loopback
from neuron.server.keepalive import KEEP_ALIVE_S, pump, sse
from neuron.server.keys import Key, Keys, given_key
from neuron.tracing import RequestSpan, Tracing

if TYPE_CHECKING:
    from neuron.engine.engine import Engine
    from neuron.models.progress import Download

log = structlog.get_logger("neuron.server")

MAX_BODY_BYTES = 4 * 1024 * 1024  # any body but one carrying images (--max-image-body-bytes)
OFF_LOOP_BYTES = 64 * 1024
T = TypeVar("T")
ErrorBody = Callable[[ApiError], dict[str, Any]]


@dataclass(slots=True)
class ServerState:
    model_id: str
    keys: Keys | None = None  # the API keys it takes (``server.keys``); None: it asks none
    engine: Engine | None = None  # None while the model loads
    status: str = "loading the model"
    started: int = 0
    # While a model named on the Hub is fetched: its progress, which /ready answers with (neuron.models.progress).
    download: Download | None = None
    tracing: Tracing | None = None  # requests' OpenTelemetry traces (--otlp-traces-endpoint); None: off


class OrjsonResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(error: ApiError, error_body: ErrorBody = openai_body) -> Response:
    return OrjsonResponse(error_body(error), status_code=error.status, headers=error.headers)


@dataclass(slots=True)
class Call:
    """One request as a handler sees it: authorized, its JSON body read and bounded (POST)."""

    request: Request
    state: ServerState
    body: Any = None
    key: Key | None = None  # the API key it came with; None where the server asks none

    @property
    def model_id(self) -> str:
        return self.state.model_id

    @property
    def served(self) -> Served:
        """The base model's id, with the LoRA adapters a generation may name instead (``fields.served``)."""
        engine = self.state.engine
        return Served(self.state.model_id, tuple(engine.adapters.names) if engine is not None else ())

    def trace(self, gen: Generation) -> RequestSpan | None:
        """The request's span where traces are on (``--otlp-traces-endpoint``), continuing its ``traceparent``."""
        tracing = self.state.tracing
        if tracing is None:
            return None
        params = gen.params
        asked = {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p}
        return tracing.start(self.request.headers, "chat" if gen.chat else "text_completion", gen.model, asked)

    async def submit(self, gen: Generation, request_id: str) -> list[Sequence]:
        """Queue ``gen`` in the engine (``common.submit``) as this call's: traced where traces are on, with its API
        key's name (its fair share, its usage), within the best priority its key may ask for."""
        key = self.key
        if key is not None and key.best_priority is not None and gen.priority < key.best_priority:
            raise ApiError(
                400,
                f"`priority` {gen.priority} is sooner than the API key {key.name!r} may ask for: give "
                f"{key.best_priority} or more (lower is sooner)",
                param="priority",
                code="priority_not_allowed",
            )
        return await submit(self.engine, gen, request_id, self.trace(gen), key.name if key is not None else None)

    @property
    def engine(self) -> Engine:
        """The engine, or a 503 while the model loads."""
        if self.state.engine is None:
            raise not_ready(f"not ready: {self.state.status}")
        return self.state.engine

    async def answer(
        self,
        seqs: list[Sequence],
        collect: Callable[[], Awaitable[Any]],
        render: Callable[[Any], Response] = OrjsonResponse,
    ) -> Response:
        """The whole reply ``collect`` makes, or a 499 (nobody will read it) when the client left first; the
        sequences are cancelled in the engine either way (a no-op for those finished)."""
        engine = self.engine
        try:
            reply = await unless_disconnected(self.request.receive, collect)
        finally:
            cancel(engine, seqs)
        return render(reply) if reply is not None else Response(status_code=499)

    def stream(
        self,
        seqs: list[Sequence],
        events: AsyncGenerator[bytes],
        error_event: Callable[[ApiError], bytes] = lambda error: sse(error.body()),
    ) -> Response:
        """The reply as server-sent events; the sequences are cancelled when the stream ends or its client leaves."""
        engine = self.engine
        return EventStream(events, on_close=lambda: cancel(engine, seqs), error_event=error_event)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One route of a family, and what the skeleton does for it."""

    path: str
    handler: Callable[[Call], Awaitable[Response]]
    method: str = "POST"  # a POST's body is read as JSON before the handler runs
    keyed: bool = True  # needs the API key (probes and scrapers carry none)
    strict_json: bool = False  # a body not sent as application/json is refused (415) before it is read
    generates: bool = False  # its refusals count as rejected requests in the metrics
    error_body: ErrorBody = openai_body  # the family's error shape
    images: bool = False  # its body may carry images: it may be as large as --max-image-body-bytes
    challenge: str = "Bearer"  # the 401's WWW-Authenticate: a page's Basic one makes a browser ask for the key
    admin: bool = False  # changes what is served: the API key, or with none set a loopback client (``authorize_admin``)

    def route(self) -> Route:
        async def run(request: Request) -> Response:
            state: ServerState = request.app.state.neuron
            key = None
            if self.admin:
                key = authorize_admin(request, state)
            elif self.keyed:
                key = authorize(request, state, self.challenge)
            if key is not None:  # its refusals count against it (``exception_handlers``)
                request.state.key = key.name
            try:
                body = await read_json(request, self.body_limit(state)) if self.method == "POST" else None
            except ClientDisconnect:  # gone before its body arrived: nothing was asked, and nobody reads an answer
                return Response("the client disconnected before its body arrived", status_code=400)
            return await self.handler(Call(request, state, body, key))

        return Route(self.path, run, methods=[self.method])

    def body_limit(self, state: ServerState) -> tuple[int, str]:
        """The most bytes its body may take, and the setting that says so: a route that takes images, while the
        model may take them (it is still loading, or it does), takes photos in base64."""
        if self.images and (state.engine is None or state.engine.vision):
            return images.LIMITS.max_image_body_bytes, " (--max-image-body-bytes): send smaller images"
        return MAX_BODY_BYTES, ""


def authorize(request: Request, state: ServerState, challenge: str = "Bearer") -> Key | None:
    """The API key the request gave, where the server asks one (None where it asks none); a 401 where it gave
    none of them."""
    if state.keys is None:
        return None
    given = given_key(request.headers)
    if not given:
        raise ApiError(
            401,
            "no API key given: send the header `Authorization: Bearer KEY` (or `x-api-key: KEY`, or the key as "
            "the password of HTTP Basic)",
            code="invalid_api_key",
            headers={"www-authenticate": challenge},
        )
    if (key := state.keys.find(given)) is None:
        raise ApiError(401, "incorrect API key", code="invalid_api_key", headers={"www-authenticate": challenge})
    return key


def authorize_admin(request: Request, state: ServerState) -> Key | None:
    """An admin route (one that changes what is served or where: adapters, hosts): an API key with the admin right
    where keys are set (each ``--api-key``, those the keys file marks ``"admin": true``); with none, a client on this
    machine's loopback only. Why not open as ``/v1`` is without a key: a server bound to a routable address with no
    key serves anyone its model, which is the operator's choice, but must not let anyone reshape it."""
    if state.keys is not None:
        key = authorize(request, state)
        if key is not None and not key.admin:
            raise ApiError(
                403,
                f"{request.url.path} is an admin route, and the API key {key.name!r} may not call it: use a key the "
                'keys file (--api-keys-file) marks "admin": true, or one given with --api-key',
                type="permission_error",
                code="admin_needs_key",
            )
        return key
    client = request.client.host if request.client is not None else None
    if not loopback(client):
        raise ApiError(
            403,
            f"{request.url.path} is an admin route, and with no API key set the server takes admin requests from "
            f"its own host only (loopback), not from {client or 'an unknown address'}: call it from the server's "
            "host, or start the server with --api-key KEY (NEURON_API_KEY) and send that key",
            type="permission_error",
            code="admin_needs_key",
        )
    return None


def open_to_others(address: str, keys: Keys | None) -> bool:
    """Whether a server listening on ``address`` answers other machines' clients with no key asked: bound beyond
    loopback (an interface's address, or every interface's: ``0.0.0.0``, ``::``) with no API key set."""
    return keys is None and not loopback(address)


async def read_json(request: Request, limit: tuple[int, str] = (MAX_BODY_BYTES, "")) -> Any:
    most, setting = limit
    too_large = ApiError(413, f"the body is over {most:,} bytes{setting}", code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > most):
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > most:
            raise too_large
    if len(body) > OFF_LOOP_BYTES:  # a few MiB of values take a few hundred ms to read and walk: not on the loop
        return await anyio.to_thread.run_sync(_parsed, body)
    return _parsed(body)


def _parsed(body: bytearray) -> Any:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
    within_limits(limits.check_body, value)
    return value


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run ``work``; if the client disconnects first, cancel it and return None."""
    result: list[T] = []
    try:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await _until_disconnect(receive)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            result.append(await work())
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The task group wraps what ``work`` raised; the error handlers want it as it was.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return result[0] if result else None


class EventStream(Response):
    """Server-sent events that stop when the client disconnects, and always run ``on_close``; a comment keeps a
    silent stream open (``keepalive``).

    ``on_close`` runs even when the body never started, so a request whose client
    left early is still cancelled in the engine.
    """

    def __init__(
        self,
        events: AsyncGenerator[bytes],
        on_close: Callable[[], None],
        error_event: Callable[[ApiError], bytes] = lambda error: sse(error.body()),
    ) -> None:
        # No Response.__init__: it would declare a Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # nginx: pass each event on at once
        ]
        self.events = events
        self.on_close = on_close
        self.error_event = error_event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:

            async def body(data: bytes) -> None:
                await send({"type": "http.response.body", "body": data, "more_body": True})

            async def stream() -> None:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                try:
                    await pump(self.events, body, KEEP_ALIVE_S)
                except Exception as e:
                    # Headers are sent: a bug still ends the stream with an error event, not a dropped connection.
                    log.exception("stream failed", path=scope.get("path"))
                    error = ApiError(
                        500,
                        f"internal error ({type(e).__name__}); the server log has the details",
                        type="server_error",
                        code="server_error",
                    )
                    await body(self.error_event(error))
                await send({"type": "http.response.body", "body": b"", "more_body": False})

            await unless_disconnected(receive, stream)
        finally:
            self.on_close()
            with anyio.CancelScope(shield=True):
                await self.events.aclose()


# Errors, each in the shape of the family whose path it is on.

ROUTES_HINT = (
    "/v1/models, /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/embeddings, /tokenize"
)
ExceptionHandler = Callable[[Request, Exception], Awaitable[Response]]


def exception_handlers(endpoints: Sequence_[Endpoint]) -> dict[Any, ExceptionHandler]:
    """Starlette's handlers for ``ApiError``, its own ``HTTPException`` (404, 405) and anything else (500)."""
    shapes = {e.path: e.error_body for e in endpoints}
    generating = {e.path for e in endpoints if e.generates}

    def respond(request: Request, error: ApiError) -> Response:
        return error_response(error, shapes.get(request.url.path, openai_body))

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        if request.url.path in generating:
            metrics.REQUESTS.labels("rejected").inc()
            if (key := getattr(request.state, "key", None)) is not None:
                metrics.KEY_REQUESTS.labels(key, "rejected").inc()
        log.info("request refused", path=request.url.path, status=exc.status, param=exc.param, error=exc.message)
        return respond(request, exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see {ROUTES_HINT}"
        else:
            message = f"{exc.detail}: {request.method} {request.url.path}"
        code = "not_found" if exc.status_code == 404 else None
        # The headers carry what the status promises, such as 405's Allow.
        return respond(request, ApiError(exc.status_code, message, code=code, headers=dict(exc.headers or {})))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("internal error", path=request.url.path)
        message = f"internal error ({type(exc).__name__}); the server log has the details"
        return respond(request, ApiError(500, message, type="server_error"))

    return {ApiError: api_error, HTTPException: http_error, Exception: internal_error}
