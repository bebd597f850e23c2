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

from neuron.sampling_params import LOGIT_BIAS, MAX_STOPS, RANGES
from neuron.server import completions, responses, tools
from neuron.server.openai import (
    CHAT_MAX_TOKENS,
    COMPLETION_UNSUPPORTED,
    IGNORED,
    INT64,
    MAX_COMPLETION_LOGPROBS,
    ROLES,
    UNSUPPORTED,
)

Schema = dict[str, Any]
REF = "#/components/schemas/"


def _ref(name: str) -> Schema:
    return {"$ref": REF + name}


def _or_null(schema: Schema) -> Schema:
    """Every optional field also takes null, meaning "the default", as OpenAI's do."""
    return {"anyOf": [schema, {"type": "null"}]}


def _integer(low: int = INT64[0], high: int = INT64[1]) -> Schema:
    return {"type": "integer", "minimum": low, "maximum": high}


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


def _ranged(name: str, kind: str) -> Schema:
    """A sampling field of ``kind`` within its ``RANGES`` bounds (integers capped at int64), or null."""
    schema = {"type": kind, **RANGES[name].json_schema()}
    if kind == "integer" and "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = INT64[1]
    return _or_null(schema)


def _sampling_properties(vocab_size: int | None, max_n: int | None) -> Schema:
    bias_keys: Schema = {"pattern": below(vocab_size)} if vocab_size else {"pattern": "^[0-9]+$"}
    return {
        "temperature": _ranged("temperature", "number"),
        "top_p": _ranged("top_p", "number"),
        "top_k": _ranged("top_k", "integer"),
        "min_p": _ranged("min_p", "number"),
        "seed": _ranged("seed", "integer"),
        "presence_penalty": _ranged("presence_penalty", "number"),
        "frequency_penalty": _ranged("frequency_penalty", "number"),
        "repetition_penalty": _ranged("repetition_penalty", "number"),
        "logit_bias": _or_null(
            {
                "type": "object",
                "propertyNames": bias_keys,
                "additionalProperties": {"type": "number", **LOGIT_BIAS.json_schema()},
                "description": "token id (a decimal string) -> bias added to its logit",
            }
        ),
        "stop": _or_null(
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOPS},
                ]
            }
        ),
        "n": _or_null(
            {
                **_integer(1, max_n or INT64[1]),
                "description": "choices per prompt, sampled independently from one computation of the prompt; "
                "with a seed, choice i draws with seed + i",
            }
        ),
        **completions.extension_properties(vocab_size),
        "stream": _or_null({"type": "boolean"}),
        "stream_options": _or_null({"type": "object", "properties": {"include_usage": _or_null({"type": "boolean"})}}),
    }


def _passthrough(chat: bool) -> Schema:
    unsupported = {
        name: {"enum": [None, *neutral], "description": f"{reason}; only null or a neutral value is accepted"}
        for name, (reason, neutral) in (UNSUPPORTED if chat else COMPLETION_UNSUPPORTED).items()
    }
    ignored = {name: {"description": "accepted and ignored"} for name in sorted(IGNORED)}
    return {**unsupported, **ignored}


def _requires(field: str, kind: str, needs: str) -> Schema:
    """``field``, when given (not null), needs ``needs`` set to true."""
    return {
        "if": {"properties": {field: {"type": kind}}, "required": [field]},
        "then": {"properties": {needs: {"const": True}}, "required": [needs]},
    }


JSON_STRING = _or_null({"type": "string", "description": "JSON"})
RESPONSE_FORMAT = _or_null(
    {
        "anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "description": _or_null({"type": "string"}),
                            "schema": _or_null({"type": "object"}),
                            "strict": _or_null({"type": "boolean"}),
                        },
                    },
                },
            },
        ],
        "description": "json_object or json_schema: enforced while decoding; a schema the grammar engine cannot "
        "enforce is a 400 naming the keyword (code unsupported_schema)",
    }
)


def _request(
    model_id: str, vocab_size: int | None, context: int | None, max_n: int | None, *, chat: bool, auto_tools: bool
) -> Schema:
    max_tokens = _or_null(
        {
            **_integer(int((CHAT_MAX_TOKENS if chat else RANGES["max_tokens"]).low)),
            "description": "tokens to generate; more than the context leaves after the prompt is cut to fit",
        }
    )
    properties: Schema = {"model": {"type": "string", "enum": [model_id]}, **_sampling_properties(vocab_size, max_n)}
    tokens: Schema = {"type": "array", "minItems": 1, "items": _integer(0, (vocab_size or 2**63) - 1)}
    if context:
        tokens["maxItems"] = context - 1
    prompt_note = f"at most {context - 1} tokens" if context else "shorter than the model's context"
    if chat:
        part = {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        }
        message = {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"enum": list(ROLES)},
                "content": _or_null({"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}),
                "tool_calls": _or_null(
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["function"],
                            "properties": {
                                "function": {
                                    "type": "object",
                                    "required": ["name"],
                                    "properties": {"name": {"type": "string"}, "arguments": JSON_STRING},
                                }
                            },
                        },
                    }
                ),
                "tool_call_id": _or_null({"type": "string"}),
            },
        }
        properties |= {
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": message,
                "description": f"the chat, through the model's template: {prompt_note}",
            },
            "max_tokens": max_tokens,
            "max_completion_tokens": max_tokens,
            "logprobs": _or_null({"type": "boolean"}),
            "top_logprobs": _ranged("logprobs", "integer"),
            "response_format": RESPONSE_FORMAT,
            **tools.request_properties(auto_tools),
        }
        required = ["model", "messages"]
        rules = [
            _requires("stream_options", "object", "stream"),
            _requires("top_logprobs", "integer", "logprobs"),
            *tools.request_rules(auto_tools),
            completions.ONE_CONSTRAINED,
        ]
    else:
        text = {"type": "string", "minLength": 1}
        properties |= {
            "prompt": {
                "anyOf": [
                    text,
                    tokens,
                    {"type": "array", "minItems": 1, "items": {"anyOf": [text, tokens]}},
                ],
                "description": f"text or token ids ({prompt_note}), or a list of them: a choice per prompt",
            },
            "max_tokens": {**max_tokens, "default": 16},
            "logprobs": _or_null(_integer(0, MAX_COMPLETION_LOGPROBS)),
            "echo": _or_null(
                {"type": "boolean", "description": "the prompt before the completion; with logprobs, scored"}
            ),
            "response_format": RESPONSE_FORMAT,
        }
        required = ["model", "prompt"]
        rules = [_requires("stream_options", "object", "stream"), completions.ONE_CONSTRAINED]
    return {
        "type": "object",
        "required": required,
        "properties": properties | _passthrough(chat),
        "additionalProperties": False,
        "allOf": rules,
    }


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
    404: "no such model",
    413: "the body is too large",
    429: "the queue is full; retry after Retry-After seconds",
    500: "a step failed; the server log has the details",
    503: "not ready (loading, recovering or shutting down); retry after Retry-After seconds",
}


def _components(model_id: str) -> Schema:
    logprob = {
        "type": "object",
        "required": ["token", "logprob", "bytes"],
        "properties": {
            "token": {"type": "string"},
            "logprob": {"type": "number"},
            "bytes": {"type": "array", "items": _integer(0, 255)},
        },
    }
    chat_logprobs = _or_null(
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
    completion_logprobs = _or_null(
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
                    for k in ("accepted_prediction_tokens", "rejected_prediction_tokens")
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
    auto_tools: bool = True,
    max_n: int | None = None,
) -> Schema:
    """The OpenAPI document for a server serving ``model_id``; the bounds are the loaded model's, once loaded.
    ``auto_tools``: whether the model's template shows it tools and mlx-lm can read its calls."""
    secured = {"security": [{"bearer": []}]} if keyed else {}
    probe = {"security": []}

    def get(summary: str, responses: Schema, **extra: Any) -> Schema:
        return {"get": {"summary": summary, "responses": responses, **extra}}

    def generate(summary: str, chat: bool) -> Schema:
        body = _request(model_id, vocab_size, context, max_n, chat=chat, auto_tools=auto_tools)
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                "responses": _responses(
                    400, 401, 404, 413, 429, 500, 503, ok=_ref("ChatCompletion" if chat else "Completion"), stream=True
                ),
                **secured,
            }
        }

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
                        "content": {"application/json": {"schema": responses.request_schema(model_id, auto_tools)}},
                    },
                    "responses": _responses(
                        400, 401, 404, 413, 429, 500, 503, ok=responses.response_schema(model_id), stream=True
                    ),
                    **secured,
                }
            },
        },
        "components": {
            "schemas": _components(model_id),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
