"""The OpenAPI pieces of the Messages API (``anthropic``) and of ``/tokenize`` and ``/detokenize`` (``tokenize``),
every bound read from where the checks read it."""

from __future__ import annotations

from typing import Any

from neuron.sampling_params import MAX_STOPS, RANGES
from neuron.server.anthropic import IGNORED_HERE, STOP_REASONS, TOOL_IGNORED
from neuron.server.completions_schema import integer, or_null
from neuron.server.openai_api import CHAT_MAX_TOKENS, INT64
from neuron.server.reasoning import TEMPLATE_KWARGS
from neuron.server.tools import NAME

Schema = dict[str, Any]


def _ranged(name: str, kind: str) -> Schema:
    schema = {"type": kind, **RANGES[name].json_schema()}
    if kind == "integer" and "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = INT64[1]
    return schema


TEXT = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
TEXTS: Schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT}]}
TOOL_USE = {
    "type": "object",
    "required": ["type", "id", "name", "input"],
    "properties": {
        "type": {"const": "tool_use"},
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
    },
}
TOOL_RESULT = {
    "type": "object",
    "required": ["type", "tool_use_id"],
    "properties": {
        "type": {"const": "tool_result"},
        "tool_use_id": {"type": "string"},
        "content": TEXTS,
        "is_error": or_null({"type": "boolean"}),
    },
}
THINKING_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["thinking", "redacted_thinking"]}},
    "description": "earlier thinking: left out of the prompt, as chat templates do",
}


def messages_request(model_id: str, counting: bool = False) -> Schema:
    """``POST /v1/messages`` (or, ``counting``, ``/v1/messages/count_tokens``)."""

    def turn(role: str, *blocks: Schema) -> Schema:
        content = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": list(blocks)}}]}
        return {
            "type": "object",
            "required": ["role", "content"],
            "properties": {"role": {"const": role}, "content": content},
        }

    turns = [turn("user", TEXT, TOOL_RESULT), turn("assistant", TEXT, TOOL_USE, THINKING_BLOCK), turn("system", TEXT)]
    message = {"anyOf": turns}
    tool = {
        "type": "object",
        "required": ["name", "input_schema"],
        "properties": {
            "type": {"enum": ["custom", None]},
            "name": {"type": "string", "pattern": f"^{NAME.pattern}$"},
            "description": or_null({"type": "string"}),
            "input_schema": {"type": "object", "description": "a JSON schema; enforced for forced calls"},
        }
        | {key: {"description": "accepted and ignored"} for key in sorted(TOOL_IGNORED)},
        "additionalProperties": False,
    }
    parallel = {"disable_parallel_tool_use": or_null({"type": "boolean"})}
    kinds = ["auto", "any", "none"]
    choice = {
        "anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": kinds}, **parallel}},
            {
                "type": "object",
                "required": ["type", "name"],
                "properties": {"type": {"const": "tool"}, "name": {"type": "string"}, **parallel},
                "description": "one of `tools` by name",
            },
        ]
    }
    thinking = {
        "anyOf": [
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"const": "enabled"}, "budget_tokens": or_null(integer(1))},
            },
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["disabled", "adaptive"]}}},
        ],
        "description": "the chat template's thinking section on or off (enable_thinking); budget_tokens is not "
        "enforced",
    }
    properties: Schema = {
        "model": {"type": "string", "enum": [model_id]},
        "system": or_null(TEXTS),
        "messages": {"type": "array", "minItems": 1, "items": message},
        "tools": or_null({"type": "array", "items": tool}),
        "tool_choice": or_null(choice),
        "thinking": or_null(thinking),
        "cache_control": {"description": "accepted and ignored"},
        "output_config": or_null(OUTPUT_CONFIG),
    }
    forced = {"type": "object", "properties": {"type": {"enum": ["any", "tool"]}}}
    rules: list[Schema] = [
        {
            # A schema for the text and a forced call both shape the output: one constraint per request.
            "not": {
                "required": ["tool_choice", "output_config"],
                "properties": {
                    "tool_choice": forced,
                    "output_config": {
                        "type": "object",
                        "required": ["format"],
                        "properties": {"format": {"type": "object"}},
                    },
                },
            }
        },
        {
            # A call the request forces needs tools to call.
            "if": {
                "required": ["tool_choice"],
                "properties": {"tool_choice": {"type": "object", "properties": {"type": {"enum": ["any", "tool"]}}}},
            },
            "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
        },
    ]
    required = ["model", "messages"]
    if not counting:
        required.append("max_tokens")
        properties |= {
            "max_tokens": integer(int(CHAT_MAX_TOKENS.low)),
            "stop_sequences": or_null({"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOPS}),
            "temperature": or_null(_ranged("temperature", "number")),
            "top_p": or_null(_ranged("top_p", "number")),
            "top_k": or_null(_ranged("top_k", "integer")),
            "stream": or_null({"type": "boolean"}),
        } | {name: {"description": "accepted and ignored"} for name in sorted(IGNORED_HERE)}
    return {
        "type": "object",
        "required": required,
        "properties": properties,
        "additionalProperties": False,
        "allOf": rules,
    }


OUTPUT_CONFIG = {
    "type": "object",
    "properties": {
        "format": or_null(
            {
                "type": "object",
                "required": ["type", "schema"],
                "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}},
                "description": "the text is held to this JSON schema while it is generated",
            }
        ),
        "effort": {"enum": ["low", "medium", "high", "xhigh", "max", None], "description": "accepted, not applied"},
    },
    "additionalProperties": False,
}


def message_reply(model_id: str) -> Schema:
    block = {
        "anyOf": [
            TEXT,
            {
                "type": "object",
                "required": ["type", "thinking", "signature"],
                "properties": {"type": {"const": "thinking"}, "thinking": {"type": "string"}},
            },
            TOOL_USE,
        ]
    }
    counts = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    return {
        "type": "object",
        "required": ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "message"},
            "role": {"const": "assistant"},
            "model": {"const": model_id},
            "content": {"type": "array", "items": block},
            "stop_reason": {"enum": list(STOP_REASONS)},
            "stop_sequence": {"type": ["string", "null"]},
            "usage": {
                "type": "object",
                "required": ["input_tokens", "output_tokens"],
                "properties": {k: {"type": "integer", "minimum": 0} for k in counts},
            },
        },
    }


ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def tokenize_request(model_id: str, chat_messages: Schema, tools: Schema) -> Schema:
    common = {
        "model": or_null({"type": "string", "enum": [model_id]}),
        "add_special_tokens": or_null({"type": "boolean"}),
        "return_token_strs": or_null({"type": "boolean"}),
    }
    prompt = {
        "type": "object",
        "required": ["prompt"],
        "properties": common | {"prompt": {"type": "string"}},
        "additionalProperties": False,
    }
    chat = {
        "type": "object",
        "required": ["messages"],
        "properties": common
        | {
            "messages": chat_messages,
            "add_generation_prompt": or_null({"type": "boolean"}),
            "tools": tools,
            "chat_template_kwargs": or_null(TEMPLATE_KWARGS),
        },
        "additionalProperties": False,
    }
    return {"anyOf": [prompt, chat], "description": "a prompt, or a chat rendered by the model's template"}


def tokenize_reply() -> Schema:
    return {
        "type": "object",
        "required": ["count", "max_model_len", "tokens", "token_strs"],
        "properties": {
            "count": {"type": "integer", "minimum": 0},
            "max_model_len": {"type": "integer", "minimum": 1},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
        },
    }


def detokenize_request(model_id: str, vocab_size: int | None) -> Schema:
    return {
        "type": "object",
        "required": ["tokens"],
        "properties": {
            "model": or_null({"type": "string", "enum": [model_id]}),
            "tokens": {"type": "array", "items": integer(0, (vocab_size or 2**63) - 1)},
        },
        "additionalProperties": False,
    }
