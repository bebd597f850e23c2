"""The OpenAPI 3.1 document served at ``/openapi.json``, built from the limits the checks use.

It is written out rather than derived from the handlers because the handlers
check by hand, to answer in OpenAI's error shape. To keep the two from drifting,
every bound here is read from where the check reads it (``openai``, ``RANGES``,
the engine's context and vocabulary), and tests/faults/test_hostile_http.py runs
schemathesis against a live server: whatever the schema allows must be answered
2xx, whatever it forbids 4xx, and every reply must match it.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from neuron.models import Embedding
from neuron.server import anthropic_schema, embeddings, reasoning, responses, tools
from neuron.server.completions_schema import Schema, integer, or_null, request

REF = "#/components/schemas/"


def _ref(name: str) -> Schema:
    return {"$ref": REF + name}


def _responses(*errors: int, ok: Schema | None = None, stream: bool = False) -> Schema:
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
            "content": {"application/json": {"schema": _ref("Error")}},
            **({"headers": headers} if headers else {}),
        }
    return out


ERROR_MEANINGS = {
    400: "a field is wrong; `error.param` names it",
    401: "no API key, or the wrong one",
    403: "a web page's origin, or the Host header, is not allowed (settings allowed_origins, allowed_hosts)",
    404: "no such model",
    413: "the body is too large",
    415: "the body is not sent as application/json",
    429: "the queue is full; retry after Retry-After seconds",
    500: "a step failed; the server log has the details",
    503: "not ready (loading, recovering or shutting down); retry after Retry-After seconds",
}


def _components(model_id: str) -> Schema:
    logprob: Schema = {
        "type": "object",
        "required": ["token", "logprob", "bytes"],
        "properties": {
            "token": {"type": "string"},
            "logprob": {"type": "number"},
            "bytes": {"type": "array", "items": integer(0, 255)},
        },
    }
    chat_logprobs = or_null(
        {
            "type": "object",
            "required": ["content"],
            "properties": {
                "content": {
                    "type": "array",
                    "items": {
                        **logprob,
                        "required": [*logprob["required"], "top_logprobs"],
                        "properties": {**logprob["properties"], "top_logprobs": {"type": "array", "items": logprob}},
                    },
                },
                "refusal": {"type": "null"},
            },
        }
    )
    completion_logprobs = or_null(
        {
            "type": "object",
            "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
            "properties": {
                "tokens": {"type": "array", "items": {"type": "string"}},
                "token_logprobs": {
                    "type": "array",
                    "items": {"type": ["number", "null"]},
                    "description": "null for an echoed prompt's first token",
                },
                "top_logprobs": {
                    "type": "array",
                    "items": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
                },
                "text_offset": {"type": "array", "items": {"type": "integer"}},
            },
        }
    )
    finish = {"enum": ["stop", "length"]}
    usage = {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            **{k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
            "prompt_tokens_details": {
                "type": "object",
                "required": ["cached_tokens"],
                "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
            },
            "completion_tokens_details": {
                "type": "object",
                "properties": {
                    k: {"type": "integer", "minimum": 0}
                    for k in ("accepted_prediction_tokens", "rejected_prediction_tokens", "reasoning_tokens")
                },
            },
        },
    }

    def envelope(kind: str, choice: Schema) -> Schema:
        return {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                "id": {"type": "string"},
                "object": {"const": kind},
                "created": {"type": "integer"},
                "model": {"const": model_id},
                "choices": {"type": "array", "minItems": 1, "items": choice},
                "usage": _ref("Usage"),
            },
        }

    choice_base = {"index": {"type": "integer", "minimum": 0}, "finish_reason": finish}
    return {
        "Error": {
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
        },
        "Usage": usage,
        "Model": {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {
                "id": {"const": model_id},
                "object": {"const": "model"},
                "created": {"type": "integer"},
                "owned_by": {"type": "string"},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}},
        },
        "ChatCompletion": envelope(
            "chat.completion",
            {
                "type": "object",
                "required": ["index", "message", "logprobs", "finish_reason"],
                "properties": {
                    **choice_base,
                    "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
                    "message": {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": ["string", "null"], "description": "null when tool_calls"},
                            "refusal": {"type": "null"},
                            "reasoning_content": {
                                "type": ["string", "null"],
                                "description": "a thinking model's reasoning, apart from content (vLLM's)",
                            },
                            "tool_calls": {"type": "array", "minItems": 1, "items": tools.CALL},
                        },
                    },
                    "logprobs": chat_logprobs,
                },
            },
        ),
        "Completion": envelope(
            "text_completion",
            {
                "type": "object",
                "required": ["index", "text", "logprobs", "finish_reason"],
                "properties": {**choice_base, "text": {"type": "string"}, "logprobs": completion_logprobs},
            },
        ),
    }


def document(
    model_id: str,
    *,
    vocab_size: int | None,
    context: int | None,
    keyed: bool,
    max_n: int | None = None,
    reasons: bool = True,
    embedding: Embedding | None = None,
) -> Schema:
    """The OpenAPI document for a server serving ``model_id``; the bounds are the loaded model's, once loaded.
    ``reasons``: whether it takes ``reasoning_effort`` (reasoning.reasons)."""
    secured: Schema = {"security": [{"bearer": []}]} if keyed else {}
    probe: Schema = {"security": []}

    def get(summary: str, responses: Schema, **extra: Any) -> Schema:
        return {"get": {"summary": summary, "responses": responses, **extra}}

    def generate(summary: str, chat: bool) -> Schema:
        body = request(model_id, vocab_size, context, max_n, chat=chat)
        if chat:
            body["properties"] |= reasoning.request_properties(reasons)
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                "responses": _responses(
                    400,
                    401,
                    403,
                    404,
                    413,
                    415,
                    429,
                    500,
                    503,
                    ok=_ref("ChatCompletion" if chat else "Completion"),
                    stream=True,
                ),
                **secured,
            }
        }

    def post(summary: str, body: Schema, ok: Schema, errors: Schema, stream: bool = False) -> Schema:
        content = {"application/json": {"schema": ok}}
        if stream:
            event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
            content["text/event-stream"] = {"schema": {**event, "description": "one named server-sent event"}}
        responses_ = {"200": {"description": "OK", "content": content}}
        for status in (400, 401, 404, 413, 429, 500, 503):
            responses_[str(status)] = {
                "description": ERROR_MEANINGS[status],
                "content": {"application/json": {"schema": errors}},
            }
        request_body = {"required": True, "content": {"application/json": {"schema": body}}}
        return {"post": {"summary": summary, "requestBody": request_body, "responses": responses_, **secured}}

    chat_body = request(model_id, vocab_size, context, max_n, chat=True)["properties"]
    embed_body, embed_reply = embeddings.schema(model_id, vocab_size, context, embedding)
    message = anthropic_schema.message_reply(model_id)
    counted = {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": integer(0)}}
    status = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "neuron", "version": "1", "description": f"OpenAI-compatible API serving `{model_id}`"},
        "paths": {
            "/health": get("the process answers", _responses(ok=status), **probe),
            "/ready": get("the model is loaded and its last probe passed", _responses(503, ok=status), **probe),
            "/metrics": get(
                "Prometheus metrics",
                {"200": {"description": "OK", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
                **probe,
            ),
            "/openapi.json": get(
                "this document",
                {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}},
                **probe,
            ),
            "/v1/models": get("the served model", _responses(401, ok=_ref("ModelList")), **secured),
            "/v1/models/{model}": get(
                "one model",
                _responses(401, 404, ok=_ref("Model")),
                parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                **secured,
            ),
            "/v1/chat/completions": generate("a chat completion, whole or streamed", chat=True),
            "/v1/completions": generate("a text completion, whole or streamed", chat=False),
            "/v1/responses": {
                "post": {
                    "summary": "a response (OpenAI's Responses API), whole or streamed; stateless",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": responses.request_schema(model_id, reasons)}},
                    },
                    "responses": _responses(
                        400, 401, 403, 404, 413, 415, 429, 500, 503, ok=responses.response_schema(model_id), stream=True
                    ),
                    **secured,
                }
            },
            "/v1/messages": post(
                "a message (Anthropic's Messages API), whole or streamed",
                anthropic_schema.messages_request(model_id),
                message,
                anthropic_schema.ERROR,
                stream=True,
            ),
            "/v1/messages/count_tokens": post(
                "the prompt tokens of a Messages API request",
                anthropic_schema.messages_request(model_id, counting=True),
                counted,
                anthropic_schema.ERROR,
            ),
            "/v1/embeddings": {
                "post": {
                    "summary": "embeddings: the model's final hidden states, pooled and of unit length (OpenAI's)",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": embed_body}}},
                    "responses": _responses(400, 401, 403, 404, 413, 415, 429, 500, 503, ok=embed_reply),
                    **secured,
                }
            },
            "/tokenize": post(
                "a prompt or a chat as the model's tokens (vLLM's)",
                anthropic_schema.tokenize_request(model_id, chat_body["messages"], chat_body["tools"]),
                anthropic_schema.tokenize_reply(),
                _ref("Error"),
            ),
            "/detokenize": post(
                "token ids as text (vLLM's)",
                anthropic_schema.detokenize_request(model_id, vocab_size),
                {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                _ref("Error"),
            ),
        },
        "components": {
            "schemas": _components(model_id),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
