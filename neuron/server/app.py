"""The HTTP application: every family's routes put together on Starlette, behind the guard and CORS. No MLX.

The routes (20, and the page's 2): the probes and the scrape (``health``), the OpenAPI document (``openapi``), the
model list (``models``), vLLM's routes that load and unload LoRA adapters (``adapters``), the hosts' admin routes
(``hosts``), and one family per API:
``chat_completions``, ``completions``, ``responses``, ``messages`` (Anthropic's, with ``count_tokens``),
``embeddings`` and ``tokenize`` (with ``/detokenize``); the cluster's ``status``, and the ``page`` for people at
``/`` that shows it beside a chat. Each family holds its body's checks, its replies and its part of the OpenAPI
document; what they share is ``common/``, and the request's skeleton (key, body, errors, disconnects, server-sent
events) is ``http``.

Why Starlette and not FastAPI: every refusal must be OpenAI's (or Anthropic's) error body naming the field.
FastAPI's pydantic validation answers 422 in its own shape, which we would have to undo; Starlette is the
anyio-native core FastAPI is built on, without that layer.
"""

from __future__ import annotations

import time

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from neuron.server import embeddings, health, hosts, lora_adapters, models, openapi, status, tokenize
from neuron.server.chat_completions import routes as chat_completions
from neuron.server.common.schema import Schema, Spec
from neuron.server.completions import routes as completions
from neuron.server.guard import Allowed, Guard
from neuron.server.http import Endpoint, ServerState, exception_handlers
from neuron.server.messages import routes as messages
from neuron.server.page import routes as page
from neuron.server.responses import routes as responses

__all__ = ["ServerState", "build_app"]

FAMILIES = (
    health,
    models,
    lora_adapters,
    hosts,
    status,
    chat_completions,
    completions,
    responses,
    messages,
    embeddings,
    tokenize,
)


def endpoints(with_page: bool = True) -> list[Endpoint]:
    families = (*FAMILIES, page) if with_page else FAMILIES
    return [*(e for family in families for e in family.ENDPOINTS), openapi.endpoint(f.openapi for f in families)]


def describe(model_id: str) -> Schema:
    """The OpenAPI document served before a model is loaded, with a key asked: what the docs' routes page reads."""
    return openapi.document(Spec(model_id, keyed=True), (f.openapi for f in (*FAMILIES, page)))


def build_app(state: ServerState, allowed: Allowed | None = None, with_page: bool = True) -> Starlette:
    """The application; ``allowed``: the origins and hosts it answers (default: loopback pages, any IP address);
    ``with_page``: the page for people at ``/`` (``page``)."""
    state.started = state.started or int(time.time())
    allowed = allowed or Allowed.build()
    served = endpoints(with_page)
    app = Starlette(
        middleware=[
            Middleware(Guard, allowed=allowed, json_paths=[e.path for e in served if e.strict_json]),
            # Pages from an allowed origin may read the replies (their JSON POSTs are preflighted).
            Middleware(
                CORSMiddleware,
                allow_origin_regex=allowed.origins.pattern,
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"],
            ),
        ],
        routes=[e.route() for e in served],
        exception_handlers=exception_handlers(served),
    )
    app.state.neuron = state
    return app
