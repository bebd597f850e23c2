"""OpenAI's embeddings API, ``POST /v1/embeddings``: parse and check a body, turn its inputs into token ids, and
answer with the vectors in OpenAI's shape; the route and its OpenAPI paths. No MLX.

The vectors are the model's final hidden states pooled as ``models.Embedding`` says (vLLM's ``pooling_type``:
MEAN or LAST), scaled to unit length on rank 0, in the steps that decode the running sequences. vLLM's names for
what OpenAI lacks: ``truncate_prompt_tokens`` (keep each input's last k tokens; -1: as many as the context holds)
and ``add_special_tokens`` (true, as vLLM's default for embeddings).
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import structlog
from starlette.responses import Response

from neuron.engine.refusals import Overloaded, RequestError, Unavailable
from neuron.engine.sequence import Failure, Finish, Sequence
from neuron.models.folder import Embedding
from neuron.server.common import fields
from neuron.server.common.errors import ApiError, bad, failure_error, refused
from neuron.server.common.schema import (
    GENERATION_ERRORS,
    OpenApi,
    Schema,
    Spec,
    integer,
    or_null,
    post,
    replies,
    token_ids,
)
from neuron.server.common.submit import request_error
from neuron.server.http import Call, Endpoint

log = structlog.get_logger("neuron.server")

FIELDS = frozenset(
    {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens", "add_special_tokens"}
)
ENCODINGS = ("float", "base64")
MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request
NORM_FLOOR = 1e-12  # a vector cut to zeros stays zeros (torch's F.normalize guards the same way)


@dataclass(slots=True)
class EmbeddingRequest:
    inputs: list[str | list[int]]  # texts or token ids, in order
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate: int | None = None  # truncate_prompt_tokens
    add_special_tokens: bool = True


def parse(body: Any, served_model: str) -> EmbeddingRequest:
    """Check a body; raise ``ApiError`` naming the first bad field."""
    body = fields.an_object(body)
    fields.known(body, FIELDS)
    fields.model(body, served_model)
    fields.get(body, "user", "a string", lambda v: isinstance(v, str), None)  # accepted and ignored, as OpenAI's is
    if body.get("input") is None:
        message = "`input` is required: a string, an array of strings, or token ids"
        raise bad("input", message, "missing_required_parameter")
    inputs = fields.prompts(body["input"], "input")
    if len(inputs) > MAX_INPUTS:
        message = f"`input` holds at most {MAX_INPUTS} inputs, got {len(inputs)}; send them in several requests"
        raise bad("input", message)
    encoding = fields.get(body, "encoding_format", "a string", lambda v: isinstance(v, str), "float")
    if encoding not in ENCODINGS:
        raise bad("encoding_format", f"`encoding_format` must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    dimensions = fields.integer(body, "dimensions", None)
    if dimensions is not None and dimensions < 1:
        raise bad("dimensions", f"`dimensions` must be at least 1, got {dimensions}")
    truncate = fields.integer(body, "truncate_prompt_tokens", None)
    if truncate is not None and truncate != -1 and truncate < 1:
        message = f"`truncate_prompt_tokens` must be at least 1, or -1 for the whole context, got {truncate}"
        raise bad("truncate_prompt_tokens", message)
    special = fields.get(body, "add_special_tokens", "a boolean", lambda v: type(v) is bool, True)
    return EmbeddingRequest(inputs, encoding, dimensions, truncate, special)


def check_dimensions(asked: EmbeddingRequest, embedding: Embedding, served_model: str) -> None:
    """``dimensions`` may cut the vectors short only where the model was trained for it (Matryoshka); vLLM's words
    for the refusal, which clients match."""
    wanted = asked.dimensions
    if wanted is None or wanted == embedding.size:
        return
    if wanted > embedding.size:
        raise bad("dimensions", f"`dimensions` can be at most {embedding.size}, this model's size, got {wanted}")
    if embedding.cuts is not None and wanted not in embedding.cuts:
        sizes = ", ".join(str(d) for d in sorted({*embedding.cuts, embedding.size}))
        what = (
            f"only supports {sizes} matryoshka dimensions"
            if embedding.cuts
            else "does not support matryoshka representation"
        )
        message = (
            f'Model "{served_model}" {what}, changing output dimensions will lead to poor results; '
            f"send `dimensions` {sizes if embedding.cuts else embedding.size}, or leave it out"
        )
        raise bad("dimensions", message, "unsupported_value")


def prompts(asked: EmbeddingRequest, tokenizer: Any, context_length: int) -> list[list[int]]:
    """Each input as token ids (texts encoded with ``add_special_tokens``), cut to ``truncate_prompt_tokens``."""
    keep = context_length if asked.truncate == -1 else asked.truncate
    if keep is not None and keep > context_length:
        message = (
            f"`truncate_prompt_tokens` ({keep}) is more than the context holds ({context_length}); send at most "
            f"{context_length}, or -1"
        )
        raise bad("truncate_prompt_tokens", message)
    out = []
    for value in asked.inputs:
        special = asked.add_special_tokens
        ids = value if isinstance(value, list) else list(tokenizer.encode(value, add_special_tokens=special))
        out.append(ids[-keep:] if keep is not None else ids)
    return out


def vector(embedding: bytes, dimensions: int | None) -> np.ndarray:
    """One vector as rank 0 sent it (unit length, float32), cut to ``dimensions`` and scaled to unit length again."""
    values = np.frombuffer(embedding, dtype="<f4").astype(np.float32)
    if dimensions is None or dimensions >= len(values):
        return values
    cut = values[:dimensions]
    return cut / max(float(np.linalg.norm(cut)), NORM_FLOOR)


async def collect(seqs: list[Sequence], asked: EmbeddingRequest, served_model: str) -> dict[str, Any]:
    """The whole reply, once every input's vector has come; a failure as OpenAI's error."""
    data, prompt_tokens = [], 0
    for index, seq in enumerate(seqs):
        async for event in seq.events:
            if isinstance(event, Failure):
                raise failure_error(event)
            if isinstance(event, Finish):
                if not event.embedding:  # cancelled: only a shutdown does that while someone still reads
                    raise ApiError(503, "the request was cancelled; retry", type="server_error", code="not_ready")
                values = vector(event.embedding, asked.dimensions)
                encoded: Any = values
                if asked.encoding_format == "base64":
                    encoded = base64.b64encode(values.astype("<f4").tobytes()).decode()
                data.append({"object": "embedding", "embedding": encoded, "index": index})
                prompt_tokens += event.prompt_tokens
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": served_model, "usage": usage}


def render(reply: dict[str, Any]) -> bytes:
    """The reply as JSON: float32 values written as float32 (the shortest text that reads back to the same)."""
    return orjson.dumps(reply, option=orjson.OPT_SERIALIZE_NUMPY)


def schema(
    model_id: str, vocab_size: int | None, context: int | None, embedding: Embedding | None
) -> tuple[Schema, Schema]:
    """The request's and the reply's JSON schemas, for the OpenAPI document; the bounds are the loaded model's."""
    texts: Schema = {"type": "string", "minLength": 1}
    ids: Schema = {"type": "array", "minItems": 1, "items": token_ids(vocab_size)}
    if context:
        ids["maxItems"] = context
    many = {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS}
    dimensions: Schema = integer(1)
    if embedding is not None:
        cuts = embedding.cuts
        dimensions = integer(1, embedding.size) if cuts is None else {"enum": sorted({*cuts, embedding.size})}
    request = {
        "type": "object",
        "required": ["model", "input"],
        "additionalProperties": False,
        "properties": {
            "model": {"type": "string", "enum": [model_id]},
            "input": {
                "anyOf": [texts, {**many, "items": texts}, ids, {**many, "items": ids}],
                "description": f"a text or token ids, or a list of them: a vector each, at most {context} tokens"
                if context
                else "a text or token ids, or a list of them: a vector each",
            },
            "encoding_format": or_null({"enum": list(ENCODINGS)}),
            "dimensions": or_null(
                {**dimensions, "description": "the vectors' size: cut short only where the model was trained for it"}
            ),
            "user": or_null({"type": "string"}),
            "truncate_prompt_tokens": or_null(
                {
                    **(integer(-1, context) if context else integer(-1)),
                    "not": {"const": 0},
                    "description": "vLLM's: keep each input's last k tokens; -1 keeps as many as the context holds",
                }
            ),
            "add_special_tokens": or_null({"type": "boolean", "description": "vLLM's: the tokenizer's own; true"}),
        },
    }
    item = {
        "type": "object",
        "required": ["object", "embedding", "index"],
        "properties": {
            "object": {"const": "embedding"},
            "embedding": {
                "anyOf": [
                    {"type": "array", "items": {"type": "number"}},
                    {"type": "string", "description": "base64 of little-endian float32 values"},
                ]
            },
            "index": integer(0),
        },
    }
    reply = {
        "type": "object",
        "required": ["object", "data", "model", "usage"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": item},
            "model": {"const": model_id},
            "usage": {
                "type": "object",
                "required": ["prompt_tokens", "total_tokens"],
                "properties": {"prompt_tokens": integer(0), "total_tokens": integer(0)},
            },
        },
    }
    return request, reply


async def create(call: Call) -> Response:
    """Every input's vector, computed in the steps that decode the running sequences."""
    asked = parse(call.body, call.model_id)
    engine = call.engine
    check_dimensions(asked, engine.embedding, call.model_id)
    inputs = prompts(asked, engine.text.tokenizer, engine.context_length)
    request_id = f"embd-{uuid.uuid4().hex}"
    structlog.contextvars.bind_contextvars(request_id=request_id)
    started = time.perf_counter()
    try:
        seqs = engine.embed(inputs, request_id, call.key.name if call.key is not None else None)
    except RequestError as e:
        raise request_error(e, chat=False) from e
    except (Overloaded, Unavailable) as e:
        raise refused(e) from e

    def done(reply: dict[str, Any]) -> Response:
        ms = round((time.perf_counter() - started) * 1000)
        log.info("embeddings done", inputs=len(seqs), prompt_tokens=reply["usage"]["prompt_tokens"], ms=ms)
        return Response(render(reply), media_type="application/json")

    return await call.answer(seqs, lambda: collect(seqs, asked, call.model_id), done)


ENDPOINTS = (Endpoint("/v1/embeddings", create, strict_json=True),)


def openapi(spec: Spec) -> OpenApi:
    body, reply = schema(spec.model_id, spec.vocab_size, spec.context, spec.embedding)
    summary = "embeddings: the model's final hidden states, pooled and of unit length (OpenAI's)"
    return {"/v1/embeddings": post(spec, summary, body, replies(*GENERATION_ERRORS, ok=reply))}, {}
