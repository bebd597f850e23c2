"""The HTTP layer: OpenAI-compatible routes on Starlette. No MLX here.

Why Starlette and not FastAPI: our surface is six routes, and every refusal must
be OpenAI's error body naming the field. FastAPI's pydantic validation answers
422 in its own shape, which we would have to undo; Starlette is the anyio-native
core FastAPI is built on, without that layer.

A client that goes away never tears a step: the handler only tells the engine
(``engine.cancel``), and the engine drops the request at the next step boundary.
"""

from __future__ import annotations

import dataclasses
import hmac
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import orjson
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from neuron import metrics
from neuron.engine.sequence import Overloaded, RequestError, Sequence, Unavailable
from neuron.grammar import GrammarError
from neuron.sampling_params import SamplingParams
from neuron.server import (
    anthropic,
    completions,
    embeddings,
    limits,
    openai_api,
    reasoning,
    responses,
    schema,
    tokenize,
    tools,
)
from neuron.server.completions import Replies
from neuron.server.guard import Allowed, Guard
from neuron.server.keepalive import KEEP_ALIVE_S, pump
from neuron.server.openai_api import ApiError, Generation, within_limits
from neuron.server.responses import ResponseReplies
from neuron.server.tools import ToolStream

if TYPE_CHECKING:
    from neuron.engine.engine import Engine
    from neuron.progress import Download

log = structlog.get_logger("neuron.server")

MAX_BODY_BYTES = 4 * 1024 * 1024
OFF_LOOP_BYTES = 64 * 1024
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # errors in Anthropic's shape
JSON_PATHS = (*GENERATION_PATHS, "/v1/embeddings")  # bodies refused unless sent as JSON
T = TypeVar("T")


@dataclass(slots=True)
class ServerState:
    model_id: str
    api_key: str | None = None
    engine: Engine | None = None  # None while the model loads
    status: str = "loading the model"
    started: int = 0
    # While a model named on the Hub is fetched: its progress, which /ready answers with (neuron.progress).
    download: Download | None = None


class OrjsonResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(error: ApiError, path: str = "") -> Response:
    body = anthropic.error_body(error) if path in ANTHROPIC_PATHS else error.body()
    return OrjsonResponse(body, status_code=error.status, headers=error.headers)


# Plumbing shared by the routes.


def _state(request: Request) -> ServerState:
    return request.app.state.neuron


def _authorize(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    # Anthropic's clients send the key as `x-api-key`.
    key = (key if scheme.lower() == "bearer" else "") or request.headers.get("x-api-key", "")
    if not key.strip():
        raise ApiError(
            401,
            "no API key given: send the header `Authorization: Bearer KEY` (or `x-api-key: KEY`)",
            code="invalid_api_key",
            headers={"www-authenticate": "Bearer"},
        )
    # Constant time: how long the compare takes must not tell how much of the key matched.
    if not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
        raise ApiError(401, "incorrect API key", code="invalid_api_key", headers={"www-authenticate": "Bearer"})


def _engine(state: ServerState) -> Engine:
    if state.engine is None:
        raise openai_api.not_ready(f"not ready: {state.status}")
    return state.engine


async def _read_json(request: Request) -> Any:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
    if len(body) > OFF_LOOP_BYTES:  # a few MiB of values take a few hundred ms to walk: not on the event loop
        await anyio.to_thread.run_sync(within_limits, limits.check_body, value)
    else:
        within_limits(limits.check_body, value)
    return value


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> T | None:
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
        error_event: Callable[[ApiError], bytes] = lambda error: completions.sse(error.body()),
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

            await _unless_disconnected(receive, stream)
        finally:
            self.on_close()
            with anyio.CancelScope(shield=True):
                await self.events.aclose()


# Routes.


async def health(request: Request) -> Response:
    return OrjsonResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    state = _state(request)
    if state.engine is None:
        reason = state.status
    elif not state.engine.accepting:
        reason = "shutting down"
    elif state.engine.health.ready:
        return OrjsonResponse({"status": "ready", "model": state.model_id})
    else:
        reason = state.engine.health.reason
    error = openai_api.not_ready(f"not ready: {reason}")
    if state.engine is None and state.download is not None:
        body = {**error.body(), "download": state.download.snapshot()}
        return OrjsonResponse(body, status_code=error.status, headers=error.headers)
    return error_response(error)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_id, "object": "model", "created": state.started, "owned_by": "neuron"}


async def prometheus(request: Request) -> Response:
    """Unauthenticated, like /health: scrapers rarely carry keys, and it holds counts, not content."""
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    state = _state(request)
    engine = state.engine
    return OrjsonResponse(
        schema.document(
            state.model_id,
            vocab_size=engine.vocab_size if engine else None,
            context=engine.context_length if engine else None,
            keyed=state.api_key is not None,
            max_n=min(engine.limits.max_n, engine.limits.max_batch) if engine else None,
            reasons=reasoning.reasons(engine.text.tokenizer) if engine else True,
            embedding=engine.embedding if engine else None,
        )
    )


async def list_models(request: Request) -> Response:
    state = _state(request)
    _authorize(request, state)
    return OrjsonResponse({"object": "list", "data": [_model_card(state)]})


async def get_model(request: Request) -> Response:
    state = _state(request)
    _authorize(request, state)
    if request.path_params["model"] != state.model_id:
        raise ApiError(404, f"the model `{request.path_params['model']}` does not exist", code="model_not_found")
    return OrjsonResponse(_model_card(state))


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def text_completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def _generate(request: Request, *, chat: bool) -> Response:
    state = _state(request)
    _authorize(request, state)
    gen = _parse(await _read_json(request), state, chat=chat)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    engine, seqs = await _submit(state, gen, request_id)
    replies = Replies(gen, request_id, engine.text.token_text, engine.text.tokenizer.decode)
    readers = [ToolStream(gen.tools, engine.text.tool_markup) if gen.tools is not None else None for _ in seqs]
    splits = [reasoning.splitter(engine.text.tokenizer, seq.prompt) if chat else None for seq in seqs]
    if gen.stream:
        events = completions.stream(seqs, gen, replies, readers, splits)
        return EventStream(events, on_close=lambda: _cancel(engine, seqs))
    reply = await _answer(request, engine, seqs, lambda: completions.collect(seqs, replies, readers, splits))
    return OrjsonResponse(reply) if reply is not None else Response(status_code=499)


def _parse(body: Any, state: ServerState, *, chat: bool) -> Generation:
    gen = openai_api.parse(body, chat=chat, served_model=state.model_id)
    gen.tools = tools.parse(body) if chat else None
    for i, spec in enumerate((body.get("tools") or []) if chat else []):
        # Bounded whatever the choice: auto hands them to the chat template, the forced kinds to the grammar.
        where = f"tools[{i}].function.parameters"
        within_limits(limits.check_schema, spec["function"].get("parameters") or {}, where)
    gen.reasoning = reasoning.parse(body) if chat else None
    if gen.tools is not None and gen.schema is not None and not gen.tools.auto:
        raise openai_api.bad("response_format", "`response_format` and a forced `tool_choice` both shape the output")
    if gen.n > 1 and (gen.schema is not None or (gen.tools is not None and not gen.tools.auto)):
        # A constraint follows one sequence's tokens; n copies would need n compiled grammars.
        raise openai_api.bad("n", "`n` above 1 cannot be combined with `response_format` or a forced `tool_choice`")
    return gen


def _cancel(engine: Engine, seqs: list[Sequence]) -> None:
    for seq in seqs:
        engine.cancel(seq)


async def _answer(
    request: Request, engine: Engine, seqs: list[Sequence], collect: Callable[[], Awaitable[dict[str, Any]]]
) -> dict[str, Any] | None:
    """A whole reply, or None (HTTP 499: nobody will read it) when the client left first."""
    try:
        return await _unless_disconnected(request.receive, collect)
    finally:
        _cancel(engine, seqs)


async def _submit(state: ServerState, gen: Generation, request_id: str) -> tuple[Engine, list[Sequence]]:
    """Queue a checked request in the engine, a sequence per choice; refusals as OpenAI's errors."""
    chat = gen.chat
    engine = _engine(state)
    structlog.contextvars.bind_contextvars(request_id=request_id)
    text = engine.text
    seqs: list[Sequence] = []
    try:
        if chat:
            prompts = [_chat_prompt(engine, gen)]
            gen.params = reasoning.chat_params(text.tokenizer, gen.params)
        else:
            prompts = [p if isinstance(p, list) else text.encode(p) for p in gen.prompts]
        for i, prompt in enumerate(prompts):
            try:
                seq = engine.submit(prompt, await _constrained(engine, gen, prompt), request_id, gen.n)
            except RequestError as e:
                if e.param == "prompt" and len(prompts) > 1:
                    e.param = f"prompt[{i}]"
                raise
            seqs += [seq, *seq.copies]
    except RequestError as e:
        _cancel(engine, seqs)
        param = "messages" if chat and e.param == "prompt" else e.param
        raise ApiError(400, str(e), param=param, code=e.code) from e
    except (Overloaded, Unavailable) as e:
        _cancel(engine, seqs)
        raise _refused(e) from e
    return engine, seqs


def _refused(error: Overloaded | Unavailable) -> ApiError:
    if isinstance(error, Overloaded):
        return ApiError(429, str(error), type="server_error", code="queue_full", headers={"retry-after": "1"})
    return openai_api.not_ready(str(error), retry_after=error.retry_after)


def _chat_prompt(engine: Engine, gen: Generation) -> list[int]:
    """A chat's prompt: its tools and template variables through the model's template."""
    text = engine.text
    messages = tools.template_messages(gen.messages, gen.tools, text.tool_markup)
    specs = gen.tools.specs if gen.tools and text.tool_markup else None
    kwargs = reasoning.template_kwargs(
        gen.reasoning, text.tokenizer.chat_template, reasoning.Thinking.of(text.tokenizer)
    )
    return reasoning.encode_chat(text, messages, specs, kwargs)


async def _constrained(engine: Engine, gen: Generation, prompt: list[int]) -> SamplingParams:
    """The request's sampling parameters with its output constraint compiled in, if it has one. A thinking
    model's chat thinks first, unconstrained, and the constraint holds what follows its thinking section."""
    schema, param = gen.schema, "response_format"
    if schema is None and gen.tools is not None:
        schema, param = gen.tools.schema(), "tools"
    if schema is None:
        return gen.params
    try:
        # On a thread: a large schema takes up to a few hundred ms to compile (bounded by grammar.LIMITS).
        around = reasoning.grammar(engine.text.tokenizer, prompt) if gen.chat else None
        constraint = await anyio.to_thread.run_sync(engine.grammars.compile, schema, around)
    except GrammarError as e:
        message = f"`{param}`: the schema cannot be enforced: {e}; remove or rewrite that part of the schema"
        raise ApiError(400, message, param=param, code="unsupported_schema") from e
    return dataclasses.replace(gen.params, constraint=constraint)


async def create_response(request: Request) -> Response:
    state = _state(request)
    _authorize(request, state)
    body = await _read_json(request)
    try:
        gen = _parse(responses.to_chat(body), state, chat=True)
    except ApiError as e:
        raise responses.renamed(e) from None
    request_id = f"resp_{uuid.uuid4().hex}"
    engine, (seq,) = await _submit(state, gen, request_id)
    replies = ResponseReplies(gen, body, request_id, reasoning.splitter(engine.text.tokenizer, seq.prompt))
    reader = ToolStream(gen.tools, engine.text.tool_markup) if gen.tools is not None else None
    if gen.stream:
        return EventStream(
            responses.events(seq, replies, reader),
            on_close=lambda: engine.cancel(seq),
            error_event=lambda e: responses.sse(replies.event("error", code=e.code, message=e.message, param=None)),
        )
    reply = await _answer(request, engine, [seq], lambda: responses.collect(seq, replies, reader))
    return OrjsonResponse(reply) if reply is not None else Response(status_code=499)


async def create_message(request: Request) -> Response:
    """Anthropic's Messages API: the chat it describes, answered as a Message."""
    state = _state(request)
    _authorize(request, state)
    body = await _read_json(request)
    try:
        gen = _parse(anthropic.to_chat(body), state, chat=True)
    except ApiError as e:
        raise anthropic.renamed(e) from None
    request_id = f"msg_{uuid.uuid4().hex}"
    engine, (seq,) = await _submit(state, gen, request_id)
    split = reasoning.splitter(engine.text.tokenizer, seq.prompt)
    reader = ToolStream(gen.tools, engine.text.tool_markup) if gen.tools is not None else None
    if gen.stream:
        events = anthropic.events(seq, gen, request_id, split, reader)
        return EventStream(events, on_close=lambda: engine.cancel(seq))
    reply = await _answer(request, engine, [seq], lambda: anthropic.collect(seq, gen, request_id, split, reader))
    return OrjsonResponse(reply) if reply is not None else Response(status_code=499)


async def count_message_tokens(request: Request) -> Response:
    state = _state(request)
    _authorize(request, state)
    body = await _read_json(request)
    try:
        gen = _parse(anthropic.to_chat(body, counting=True), state, chat=True)
    except ApiError as e:
        raise anthropic.renamed(e) from None
    try:
        prompt = _chat_prompt(_engine(state), gen)
    except RequestError as e:
        raise ApiError(400, str(e), param="messages" if e.param == "prompt" else e.param, code=e.code) from e
    return OrjsonResponse({"input_tokens": len(prompt)})


async def create_embeddings(request: Request) -> Response:
    """OpenAI's embeddings: every input's vector, computed in the steps that decode the running sequences."""
    state = _state(request)
    _authorize(request, state)
    asked = embeddings.parse(await _read_json(request), state.model_id)
    engine = _engine(state)
    embeddings.check_dimensions(asked, engine.embedding, state.model_id)
    prompts = embeddings.prompts(asked, engine.text.tokenizer, engine.context_length)
    request_id = f"embd-{uuid.uuid4().hex}"
    structlog.contextvars.bind_contextvars(request_id=request_id)
    started = time.perf_counter()
    try:
        seqs = engine.embed(prompts, request_id)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from e
    except (Overloaded, Unavailable) as e:
        raise _refused(e) from e
    reply = await _answer(request, engine, seqs, lambda: embeddings.collect(seqs, asked, state.model_id))
    if reply is None:
        return Response(status_code=499)
    tokens = reply["usage"]["prompt_tokens"]
    log.info(
        "embeddings done", inputs=len(seqs), prompt_tokens=tokens, ms=round((time.perf_counter() - started) * 1000)
    )
    return Response(embeddings.render(reply), media_type="application/json")


async def tokenize_text(request: Request) -> Response:
    state = _state(request)
    _authorize(request, state)
    body = await _read_json(request)
    engine = _engine(state)
    return OrjsonResponse(tokenize.tokenize(engine.text, body, state.model_id, engine.context_length))


async def detokenize_tokens(request: Request) -> Response:
    state = _state(request)
    _authorize(request, state)
    body = await _read_json(request)
    engine = _engine(state)
    return OrjsonResponse(tokenize.detokenize(engine.text, body, state.model_id, engine.vocab_size))


# The application.


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if request.url.path in GENERATION_PATHS:
        metrics.REQUESTS.labels("rejected").inc()
    log.info("request refused", path=request.url.path, status=exc.status, param=exc.param, error=exc.message)
    return error_response(exc, request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        routes = (
            "/v1/models, /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/embeddings, /tokenize"
        )
        message = f"no route {request.method} {request.url.path}; see {routes}"
    else:
        message = f"{exc.detail}: {request.method} {request.url.path}"
    code = "not_found" if exc.status_code == 404 else None
    # The headers carry what the status promises, such as 405's Allow.
    error = ApiError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
    return error_response(error, request.url.path)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error", path=request.url.path)
    return error_response(
        ApiError(500, f"internal error ({type(exc).__name__}); the server log has the details", type="server_error"),
        request.url.path,
    )


def build_app(state: ServerState, allowed: Allowed | None = None) -> Starlette:
    """The application; ``allowed``: the origins and hosts it answers (default: loopback pages, any IP address)."""
    state.started = state.started or int(time.time())
    allowed = allowed or Allowed.build()
    app = Starlette(
        middleware=[
            Middleware(Guard, allowed=allowed, json_paths=JSON_PATHS),
            # Pages from an allowed origin may read the replies (their JSON POSTs are preflighted).
            Middleware(
                CORSMiddleware,
                allow_origin_regex=allowed.origins.pattern,
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"],
            ),
        ],
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", text_completions, methods=["POST"]),
            Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/messages", create_message, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"]),
            Route("/v1/embeddings", create_embeddings, methods=["POST"]),
            Route("/tokenize", tokenize_text, methods=["POST"]),
            Route("/detokenize", detokenize_tokens, methods=["POST"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.neuron = state
    return app
