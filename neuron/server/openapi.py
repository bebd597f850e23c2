"""The OpenAPI 3.1 document served at ``/openapi.json``, put together from each family's ``openapi(spec)``.

It is written out rather than derived from the handlers because the handlers check by hand, to answer in
OpenAI's error shape. To keep the two from drifting, each family writes its part beside its checks, every
bound read from where the check reads it (``RANGES``, the engine's context and vocabulary), and
tests/e2e/faults/test_hostile_http.py runs schemathesis against a live server: whatever the schema allows must be
answered 2xx, whatever it forbids 4xx, and every reply must match it. No MLX.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from starlette.responses import Response

from neuron.server.common import reasoning
from neuron.server.common.choices import USAGE
from neuron.server.common.schema import ERROR, OpenApi, Schema, Spec, get
from neuron.server.http import Call, Endpoint, OrjsonResponse

Family = Callable[[Spec], OpenApi]
# The key as a bearer token, or as Basic's password (what a browser sends once the page has asked for it).
SCHEMES = {"bearer": {"type": "http", "scheme": "bearer"}, "basic": {"type": "http", "scheme": "basic"}}


def document(spec: Spec, families: Iterable[Family]) -> Schema:
    """The document for a server serving ``spec.model_id``; the bounds are the loaded model's, once loaded."""
    ok = {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}}
    paths: Schema = {"/openapi.json": get("this document", ok, security=[])}
    components: Schema = {"Error": ERROR, "Usage": USAGE}
    for family in families:
        more_paths, more_components = family(spec)
        paths |= more_paths
        components |= more_components
    return {
        "openapi": "3.1.0",
        "info": {"title": "neuron", "version": "1", "description": f"OpenAI-compatible API serving `{spec.model_id}`"},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": SCHEMES},
    }


def spec(call: Call) -> Spec:
    """What the document describes: before the model loads, only what the settings say."""
    state, engine = call.state, call.state.engine
    if engine is None:
        return Spec(state.model_id, keyed=state.keys is not None)
    return Spec(
        call.served,  # with the LoRA adapters a request's ``model`` may name
        vocab_size=engine.vocab_size,
        context=engine.context_length,
        keyed=state.keys is not None,
        max_n=min(engine.limits.max_n, engine.limits.max_batch),
        reasons=reasoning.reasons(engine.text.tokenizer),
        embedding=engine.embedding,
    )


def endpoint(families: Iterable[Family]) -> Endpoint:
    """``GET /openapi.json``, unauthenticated: it describes the API, and holds no content."""
    families = tuple(families)

    async def serve(call: Call) -> Response:
        return OrjsonResponse(document(spec(call), families))

    return Endpoint("/openapi.json", serve, method="GET", keyed=False)
