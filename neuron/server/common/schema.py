"""What every family's part of the OpenAPI document is built with: JSON Schema helpers, what the document is
asked for (``Spec``), and the shape of a path's replies and errors. Each family exports ``openapi(spec)``, its
paths and components, beside the checks they describe; ``server/openapi.py`` puts them together. No MLX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neuron.models.folder import Embedding
from neuron.sampling_params import RANGES
from neuron.server.common.fields import INT64, Served

Schema = dict[str, Any]
OpenApi = tuple[Schema, Schema]  # a family's paths and its components' schemas
REF = "#/components/schemas/"


@dataclass(frozen=True, slots=True)
class Spec:
    """What the document describes: the served model and, once it is loaded, its bounds."""

    model_id: str
    vocab_size: int | None = None
    context: int | None = None
    keyed: bool = False  # an API key is needed
    max_n: int | None = None
    reasons: bool = True  # takes ``reasoning_effort`` (reasoning.reasons)
    embedding: Embedding | None = None

    @property
    def secured(self) -> Schema:
        return {"security": [{"bearer": []}, {"basic": []}]} if self.keyed else {}


def served_names(model_id: str) -> list[str]:
    """What a request's ``model`` may name: the base model, or a LoRA adapter served beside it (``fields.Served``)."""
    return [model_id, *(model_id.adapters if isinstance(model_id, Served) else ())]


def or_null(schema: Schema) -> Schema:
    """Every optional field also takes null, meaning "the default", as OpenAI's do."""
    return {"anyOf": [schema, {"type": "null"}]}


def integer(low: int = INT64[0], high: int = INT64[1]) -> Schema:
    return {"type": "integer", "minimum": low, "maximum": high}


def ranged(name: str, kind: str) -> Schema:
    """A sampling field of ``kind`` within its ``RANGES`` bounds (integers capped at int64)."""
    schema = {"type": kind, **RANGES[name].json_schema()}
    if kind == "integer" and "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = INT64[1]
    return schema


def below(limit: int) -> str:
    """A regex for the decimal numbers in [0, limit), leading zeros allowed: logit_bias's keys."""
    top = str(limit - 1)
    shorter = f"[0-9]{{1,{len(top) - 1}}}" if len(top) > 1 else None
    same_length = []
    for i, digit in enumerate(top):
        if digit != "0":
            rest = len(top) - i - 1
            lower = "0" if digit == "1" else f"[0-{int(digit) - 1}]"
            same_length.append(top[:i] + lower + (f"[0-9]{{{rest}}}" if rest else ""))
    same_length.append(top)
    return "^0*(" + "|".join(filter(None, [shorter, *same_length])) + ")$"


def token_ids(vocab_size: int | None) -> Schema:
    return integer(0, (vocab_size or 2**63) - 1)


def ref(name: str) -> Schema:
    return {"$ref": REF + name}


ERROR_MEANINGS = {
    400: "a field is wrong; `error.param` names it",
    401: "no API key, or the wrong one",
    403: "a web page's origin, or the Host header, is not allowed (settings allowed_origins, allowed_hosts), or an "
    "admin route was called from another host while no API key is set",
    404: "no such model (or, for the hosts' routes, no such spare)",
    409: "the change conflicts with the group as it stands (a host already in it; a rank's host named as a spare)",
    413: "the body is too large",
    415: "the body is not sent as application/json",
    422: "a host that cannot serve: out of reach, other versions, too little memory (the message says which)",
    429: "the queue is full; retry after Retry-After seconds",
    500: "a step failed; the server log has the details",
    503: "not ready (loading, recovering or shutting down); retry after Retry-After seconds",
}
GENERATION_ERRORS = (400, 401, 403, 404, 413, 415, 429, 500, 503)
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def replies(*errors: int, ok: Schema | None = None, stream: bool = False) -> Schema:
    """A path's replies: ``ok`` (JSON, or server-sent events too), and each error status in OpenAI's shape."""
    out: Schema = {}
    if ok is not None:
        content = {"application/json": {"schema": ok}}
        if stream:
            event = {
                "type": "object",
                "required": ["data"],
                "properties": {"data": {"type": "string"}},
                "description": "one server-sent event: a chunk as JSON, an error body as JSON, or [DONE]",
            }
            content["text/event-stream"] = {"schema": event}
        out["200"] = {"description": "OK", "content": content}
    for status in errors:
        headers = {"Retry-After": {"schema": {"type": "string"}}} if status in (429, 503) else {}
        out[str(status)] = {
            "description": ERROR_MEANINGS[status],
            "content": {"application/json": {"schema": ref("Error")}},
            **({"headers": headers} if headers else {}),
        }
    return out


def get(summary: str, responses: Schema, **extra: Any) -> Schema:
    return {"get": {"summary": summary, "responses": responses, **extra}}


def post(spec: Spec, summary: str, body: Schema, responses: Schema) -> Schema:
    request = {"required": True, "content": {"application/json": {"schema": body}}}
    return {"post": {"summary": summary, "requestBody": request, "responses": responses, **spec.secured}}


ADMIN = (
    "An admin route: it needs the API key where the server has one; with none set, it answers clients on the "
    "server's own host (loopback) only, and refuses others with 403."
)


def admin_post(spec: Spec, summary: str, body: Schema, responses: Schema) -> Schema:
    """An admin route's POST (``http.authorize_admin``): tagged, and saying who may call it."""
    operation = post(spec, summary, body, responses)
    operation["post"] |= {"tags": ["admin"], "description": ADMIN}
    return operation


def replies_with(errors: Schema, ok: Schema, stream: bool = False) -> Schema:
    """Replies whose errors have their own ``errors`` shape and whose stream names each event."""
    content = {"application/json": {"schema": ok}}
    if stream:
        event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
        content["text/event-stream"] = {"schema": {**event, "description": "one named server-sent event"}}
    out: Schema = {"200": {"description": "OK", "content": content}}
    for status in (400, 401, 404, 413, 429, 500, 503):
        out[str(status)] = {"description": ERROR_MEANINGS[status], "content": {"application/json": {"schema": errors}}}
    return out
