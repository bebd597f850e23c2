"""The router's HTTP application: each request goes to the server of the model its body names, loaded first if it
is not; the router answers for itself only what spans the models (the list of models and their states, loading
and unloading one, health, status and metrics). No MLX.

Why the body is read here: ``model`` is in it, on every API (OpenAI's, Anthropic's, vLLM's tokenize). It is
forwarded as it came, but for Ollama's ``keep_alive``, which is the router's to act on. Keys are checked by the
model's server for what it answers (it holds the same keys), and here for what the router answers itself.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import anyio
import httpx
import orjson
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from neuron.router.child import Child, LoadFailed
from neuron.router.declared import duration
from neuron.router.fleet import CannotFit, Crowded, Fleet
from neuron.router.metrics import RouterMetrics
from neuron.server.app import describe
from neuron.server.common.fields import Served
from neuron.server.common.schema import ADMIN, Spec, post
from neuron.server.guard import loopback
from neuron.server.keepalive import KEEP_ALIVE, KEEP_ALIVE_S
from neuron.server.keys import Key, Keys, given_key
from neuron.server.page.routes import CHALLENGE, FILES, HEADERS, TYPES

log = structlog.get_logger("neuron.router")

# The routes that generate, score or count, each naming its model in the body.
FORWARDED = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}
MAX_BODY_BYTES = 80 * 1024 * 1024  # above any model's own limit (images included): the model's server refuses first


class Refused(Exception):
    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}

    def response(self, path: str) -> JSONResponse:
        if path.startswith("/v1/messages"):  # Anthropic's clients read their own error shape
            kind = {404: "not_found_error", 401: "authentication_error", 403: "permission_error"}.get(
                self.status, "api_error" if self.status >= 500 else "invalid_request_error"
            )
            body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": self.message}}
        else:
            kind = "server_error" if self.status >= 500 else "invalid_request_error"
            body = {"error": {"message": self.message, "type": kind, "param": None, "code": self.code}}
        return JSONResponse(body, self.status, headers=self.headers)


class Router:
    def __init__(self, fleet: Fleet, keys: Keys | None) -> None:
        self.fleet = fleet
        self.keys = keys
        self.metrics = RouterMetrics()
        # No pool limit: every request in flight holds a connection to its model's server, as the client's did here.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits)
        self.started = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/models/load", self.load, methods=["POST"]),
            Route("/models/unload", self.unload, methods=["POST"]),
            Route("/v1/status", self.status, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/", self.page, methods=["GET"]),
            Route("/page/{name}", self.page, methods=["GET"]),
            *(Route(path, self.forward, methods=["POST"]) for path in FORWARDED),
        ]
        return Starlette(routes=routes)

    # What the router answers itself.

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": {name: c.state for name, c in self.fleet.children.items()}})

    async def list_models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except Refused as e:
            return e.response(request.url.path)
        return JSONResponse({"object": "list", "data": [self._entry(name) for name in self.fleet.names()]})

    async def get_model(self, request: Request) -> Response:
        name = request.path_params["model"]
        try:
            self._authorize(request)
            self._child(name)
        except Refused as e:
            return e.response(request.url.path)
        return JSONResponse(self._entry(name))

    async def load(self, request: Request) -> Response:
        try:
            self._admin(request)
            child = self._child(await self._named(request), own=True)
            await self.fleet.load(child.model.name)
        except Refused as e:
            return e.response(request.url.path)
        except (LoadFailed, CannotFit) as e:
            return _refusal(child, e).response("")
        return JSONResponse({"success": True, **self._entry(child.model.name)})

    async def unload(self, request: Request) -> Response:
        try:
            self._admin(request)
            child = self._child(await self._named(request), own=True)
        except Refused as e:
            return e.response(request.url.path)
        await self.fleet.unload(child.model.name, "asked to unload (/models/unload)")
        return JSONResponse({"success": True, **self._entry(child.model.name)})

    async def status(self, request: Request) -> Response:
        """Every model's state and its server's own status; with ``?model=NAME``, that model's server's status
        alone, as a single server answers it, and the models beside it (what the page shows, its picker too)."""
        try:
            self._authorize(request)
            name = request.query_params.get("model")
            child = None if name is None else self._child(name)
        except Refused as e:
            return e.response(request.url.path)
        entries = [self._entry(n) for n in self.fleet.names()]
        if child is not None:
            own = await self._ask(child, "/v1/status", request)
            return JSONResponse({**(orjson.loads(own) if own else _not_loaded(child)), "models": entries})
        models = []
        for name, child in self.fleet.children.items():
            own = await self._ask(child, "/v1/status", request)
            models.append({**self._entry(name), "in_flight": child.in_flight, "waiting": child.waiting,
                           "loads": child.loads, "server": orjson.loads(own) if own else None})  # fmt: skip
        return JSONResponse({"models": models, "swaps": self.fleet.swaps, "models_max": self.fleet.models_max})

    async def page(self, request: Request) -> Response:
        """The page every model's server serves, served here: it picks a model and shows that one."""
        try:
            if self.keys is not None and self.keys.find(given_key(request.headers)) is None:
                raise Refused(401, "the page needs the API key", "invalid_api_key", {"www-authenticate": CHALLENGE})
        except Refused as e:
            return e.response(request.url.path)
        name = request.path_params.get("name", "index.html")
        if name not in FILES:
            return Refused(404, f"the page has no file {name!r}; open / for the page", "not_found").response("")
        return Response(FILES[name], media_type=TYPES["." + name.rsplit(".", 1)[1]], headers=HEADERS)

    async def openapi(self, request: Request) -> Response:
        """A single server's document with every model a request may name, and the router's own routes."""
        names = self.fleet.names()
        document = describe(Served(names[0], tuple(names[1:])))
        named = {"type": "object", "required": ["model"], "properties": {"model": {"enum": list(self.fleet.children)}}}
        entry = {
            "200": {"description": "the model's entry, as /v1/models lists it"},
            "404": {"description": "no such model"},
        }
        for path, summary in (("/models/load", "load a model now"), ("/models/unload", "unload a model once idle")):
            document["paths"][path] = post(Spec("", keyed=self.keys is not None), summary, named, entry)
            document["paths"][path]["post"]["description"] = ADMIN
        return JSONResponse(document)

    async def prometheus(self, request: Request) -> Response:
        servers = {}
        for name, child in self.fleet.children.items():
            if (text := await self._ask(child, "/metrics", request)) is not None:
                servers[name] = text.decode()
        body = self.metrics.render(list(self.fleet.children.values()), self.fleet.swaps, servers)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    # Forwarding.

    async def forward(self, request: Request) -> Response:
        path = request.url.path
        try:
            body, content = await self._body(request)
            child = self._child(body.get("model"), path=path)
            if "keep_alive" in body:
                keep_alive, problem = duration(body.pop("keep_alive"), "keep_alive")
                if problem:
                    raise Refused(400, problem, "invalid_value")
                child.keep_alive = keep_alive
                content = orjson.dumps(body)  # the field is the router's: the model's server is sent the rest
        except Refused as e:
            return e.response(path)
        if child.state != "loaded" and body.get("stream") is True:
            return StreamingResponse(self._stream_once_loaded(child, request, content), media_type="text/event-stream")
        stack = AsyncExitStack()
        try:
            await stack.enter_async_context(self.fleet.using(child))
            upstream = await self._open(stack, child, request, content)
        except Refused as e:
            await stack.aclose()
            return e.response(path)
        except (LoadFailed, Crowded, CannotFit) as e:
            await stack.aclose()
            return _refusal(child, e).response(path)
        except BaseException:
            await stack.aclose()
            raise
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(_relay(upstream, stack, child, path), upstream.status_code, headers=headers)

    async def _stream_once_loaded(self, child: Child, request: Request, content: bytes) -> AsyncIterator[bytes]:
        """A stream asked of a model that is not loaded: SSE comments while it loads, then its server's events;
        what goes wrong meanwhile, as an error event."""
        holding = self.fleet.hold_soon(child)
        try:
            while not holding.done.is_set():
                with anyio.move_on_after(KEEP_ALIVE_S):
                    await holding.done.wait()
                if not holding.done.is_set():
                    yield KEEP_ALIVE
            if holding.error is not None:
                yield _event(_refusal(child, holding.error), request)
                return
            async with AsyncExitStack() as stack:
                try:
                    upstream = await self._open(stack, child, request, content)
                except Refused as e:
                    yield _event(e, request)
                    return
                if upstream.status_code != 200:  # the model's refusal, in its own shape, as the stream's one event
                    yield b"data: " + await upstream.aread() + b"\n\n"
                    return
                async for chunk in upstream.aiter_raw():
                    yield chunk
        finally:
            holding.release()

    async def _open(self, stack: AsyncExitStack, child: Child, request: Request, content: bytes) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        url = f"http://127.0.0.1:{child.port}{request.url.path}"
        try:
            return await stack.enter_async_context(
                self.client.stream(request.method, url, headers=headers, content=content, params=request.query_params)
            )
        except httpx.HTTPError as e:
            message = f"{child.model.name}'s server did not answer ({e}); try again"
            raise Refused(502, message, "model_unreachable") from None

    async def _ask(self, child: Child, path: str, request: Request) -> bytes | None:
        """A loaded model's own answer at ``path`` (its status, its metrics), or None."""
        if child.state != "loaded":
            return None
        headers = {"authorization": request.headers["authorization"]} if "authorization" in request.headers else {}
        try:
            reply = await self.client.get(f"http://127.0.0.1:{child.port}{path}", headers=headers)
        except httpx.HTTPError:
            return None
        return reply.content if reply.status_code == 200 else None

    # The request's parts.

    async def _body(self, request: Request) -> tuple[dict[str, Any], bytes]:
        """The body read (up to ``MAX_BODY_BYTES``) and parsed, and its bytes, forwarded as they came."""
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY_BYTES:
                raise Refused(413, f"the body is over {MAX_BODY_BYTES} bytes", "body_too_large")
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise Refused(400, f"the body is not valid JSON: {e}", "invalid_json") from None
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object", "invalid_json")
        return body, bytes(data)

    async def _named(self, request: Request) -> Any:
        return (await self._body(request))[0].get("model")

    def _child(self, name: Any, path: str = "", own: bool = False) -> Child:
        known = ", ".join(self.fleet.names() if not own else self.fleet.children)
        if not isinstance(name, str) or not name:
            raise Refused(400, f"name the model: this server serves several ({known})", "model_required")
        child = self.fleet.children.get(name) if own else self.fleet.find(name)
        if child is None:
            raise Refused(404, f"the model {name!r} does not exist; this server serves {known}", "model_not_found")
        return child

    def _entry(self, name: str) -> dict[str, Any]:
        child = self.fleet.find(name)
        assert child is not None
        status: dict[str, Any] = {"value": child.state}
        if child.why:
            status["reason"] = child.why
        entry: dict[str, Any] = {"id": name, "object": "model", "created": self.started, "owned_by": "neuron"}
        if name in self.fleet.adapters:
            entry["parent"] = child.model.name
        return {**entry, "status": status}

    def _authorize(self, request: Request) -> Key | None:
        if self.keys is None:
            return None
        if (key := self.keys.find(given_key(request.headers))) is None:
            raise Refused(401, "no API key, or an incorrect one: send `Authorization: Bearer KEY`", "invalid_api_key")
        return key

    def _admin(self, request: Request) -> None:
        key = self._authorize(request)
        if key is not None and not key.admin:
            raise Refused(
                403,
                f"{request.url.path} is an admin route, and the API key {key.name!r} may not call it: use a key "
                'the keys file marks "admin": true',
                "admin_needs_key",
            )
        if self.keys is None and not loopback(request.client.host if request.client is not None else None):
            raise Refused(
                403,
                f"{request.url.path} is an admin route, and with no API key set it is taken from this host only "
                "(loopback): call it there, or start the server with --api-key KEY",
                "admin_needs_key",
            )


def _not_loaded(child: Child) -> dict[str, Any]:
    """A model's status while its server is not running, in the shape of a server's (the page reads it so)."""
    state = child.state
    reason = f"{state}: {child.why}" if child.why else f"{state}: it loads on its first request"
    return {
        "model": {"id": child.model.name},
        "ready": False,
        "reason": reason,
        "now": time.time(),
        "queue": {"waiting": child.waiting, "running": child.in_flight},
        "counters": {"preemptions": 0, "prefix_cache_hits": 0, "prefix_cache_misses": 0},
        "recoveries": 0,
        "ranks": [],
        "events": [],
        "recent": [],
    }


def _event(refused: Refused, request: Request) -> bytes:
    return _event_body(refused, request.url.path)


def _event_body(refused: Refused, path: str) -> bytes:
    return b"data: " + bytes(refused.response(path).body) + b"\n\n"


def _refusal(child: Child, error: Exception) -> Refused:
    if isinstance(error, Crowded):
        return Refused(503, f"{error}; try again shortly", "model_queue_full", {"retry-after": "5"})
    if isinstance(error, CannotFit):
        return Refused(503, str(error), "model_too_large")
    return Refused(503, f"{child.model.name} failed to load: {error}", "model_load_failed")


async def _relay(upstream: httpx.Response, stack: AsyncExitStack, child: Child, path: str) -> AsyncIterator[bytes]:
    """The model's server's answer as it comes. Where that server goes away mid-answer (its process died), a stream
    ends with an error event the client can read, rather than a cut connection; a whole answer can only be cut."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        log.error("model server went away mid-answer", model=child.model.name, path=path, error=str(e))
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            message = f"{child.model.name}'s server went away mid-answer ({e}); send the request again"
            yield b"\n" + _event_body(Refused(502, message, "model_server_lost"), path)
    finally:
        with anyio.CancelScope(shield=True):
            await stack.aclose()
