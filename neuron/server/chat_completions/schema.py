"""``POST /v1/chat/completions`` in the OpenAPI document: its body, every bound read from where the checks read
it, and its reply (``ChatCompletion``). No MLX.
"""

from __future__ import annotations

from neuron.server.common import reasoning, tools
from neuron.server.common.chat import messages_schema
from neuron.server.common.choices import CHOICE_BASE, envelope
from neuron.server.common.generation import (
    CHAT_MAX_TOKENS,
    ONE_CONSTRAINED,
    RESPONSE_FORMAT,
    UNSUPPORTED,
    max_tokens,
    passthrough,
    requires,
    sampling_properties,
)
from neuron.server.common.schema import Schema, Spec, integer, or_null, ranged, served_names


def request(spec: Spec) -> Schema:
    limit = max_tokens(CHAT_MAX_TOKENS)
    properties: Schema = {
        "model": {"type": "string", "enum": served_names(spec.model_id)},
        **sampling_properties(spec.vocab_size, spec.max_n),
        "messages": messages_schema(spec.context),
        "max_tokens": limit,
        "max_completion_tokens": limit,
        "logprobs": or_null({"type": "boolean"}),
        "top_logprobs": or_null(ranged("logprobs", "integer")),
        "response_format": RESPONSE_FORMAT,
        **tools.request_properties(),
    }
    rules = [
        requires("stream_options", "object", "stream"),
        requires("top_logprobs", "integer", "logprobs"),
        *tools.request_rules(),
        ONE_CONSTRAINED,
    ]
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": properties | passthrough(UNSUPPORTED) | reasoning.request_properties(spec.reasons),
        "additionalProperties": False,
        "allOf": rules,
    }


def _logprobs() -> Schema:
    logprob: Schema = {
        "type": "object",
        "required": ["token", "logprob", "bytes"],
        "properties": {
            "token": {"type": "string"},
            "logprob": {"type": "number"},
            "bytes": {"type": "array", "items": integer(0, 255)},
        },
    }
    return or_null(
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


def reply(model_id: str) -> Schema:
    """``ChatCompletion``."""
    return envelope(
        model_id,
        "chat.completion",
        {
            "type": "object",
            "required": ["index", "message", "logprobs", "finish_reason"],
            "properties": {
                **CHOICE_BASE,
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
                "logprobs": _logprobs(),
            },
        },
    )
