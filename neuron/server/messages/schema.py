"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` in the OpenAPI document: the bodies, every bound read
from where the checks read it, the Message and Anthropic's error. No MLX.
"""

from __future__ import annotations

from neuron.sampling_params import MAX_STOPS
from neuron.server.common.content import ANTHROPIC_IMAGE as IMAGE
from neuron.server.common.content import ANTHROPIC_TEXT as TEXT
from neuron.server.common.generation import CHAT_MAX_TOKENS, PRIORITY_SCHEMA
from neuron.server.common.schema import Schema, integer, or_null, ranged, served_names
from neuron.server.common.tools import NAME
from neuron.server.messages.parse import IGNORED_HERE, TOOL_IGNORED
from neuron.server.messages.render import STOP_REASONS

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

    turns = [
        turn("user", TEXT, IMAGE, TOOL_RESULT),
        turn("assistant", TEXT, TOOL_USE, THINKING_BLOCK),
        turn("system", TEXT),
    ]
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
        "model": {"type": "string", "enum": served_names(model_id)},
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
            "temperature": or_null(ranged("temperature", "number")),
            "top_p": or_null(ranged("top_p", "number")),
            "top_k": or_null(ranged("top_k", "integer")),
            "stream": or_null({"type": "boolean"}),
            "priority": PRIORITY_SCHEMA,
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
            "model": {"enum": served_names(model_id)},
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
