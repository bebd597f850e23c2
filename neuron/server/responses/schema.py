"""``POST /v1/responses`` in the OpenAPI document: its body, every bound read from where the checks read it, and
its reply. No MLX.
"""

from __future__ import annotations

from typing import Any

from neuron.sampling_params import RANGES
from neuron.server.common import limits
from neuron.server.common.content import RESPONSES_PART
from neuron.server.common.fields import IGNORED, INT64
from neuron.server.common.generation import CHAT_MAX_TOKENS, PRIORITY_SCHEMA
from neuron.server.common.reasoning import EFFORTS
from neuron.server.common.schema import served_names
from neuron.server.common.tools import FUNCTION, request_rules
from neuron.server.responses.parse import ROLES


def request(model_id: str, reasons: bool = True) -> dict[str, Any]:
    def optional(schema: dict[str, Any]) -> dict[str, Any]:
        return {"anyOf": [schema, {"type": "null"}]}

    def ranged(name: str) -> dict[str, Any]:
        return optional({"type": "number", **RANGES[name].json_schema()})

    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "type": {"const": "message"},
            "role": {"enum": list(ROLES)},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": RESPONSES_PART}]},
        },
    }

    def item(kind: str, *strings: str) -> dict[str, Any]:
        properties = {"type": {"const": kind}} | {s: {"type": "string"} for s in strings}
        return {"type": "object", "required": ["type", *strings], "properties": properties}

    function = {
        **FUNCTION,
        "required": ["type", "name"],
        "properties": {"type": {"const": "function"}, **FUNCTION["properties"]},
    }
    named = {
        "type": "object",
        "required": ["type", "name"],
        "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
    }
    json_schema = {
        "type": "object",
        "required": ["type", "name"],
        "properties": {
            "type": {"const": "json_schema"},
            "name": {"type": "string", "minLength": 1},
            "description": {"type": ["string", "null"]},
            "schema": {"type": ["object", "null"]},
            "strict": {"type": ["boolean", "null"]},
        },
    }
    plain = {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}}
    structured = {"properties": {"format": {"properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}
    rules = request_rules("text", {"type": "object", "required": ["format"], **structured})
    properties = {
        "model": {"type": "string", "enum": served_names(model_id)},
        "input": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "anyOf": [
                            message,
                            item("function_call", "call_id", "name", "arguments"),
                            item("function_call_output", "call_id", "output"),
                        ]
                    },
                },
            ],
            "description": "the conversation: text, or messages with earlier function calls and their outputs",
        },
        "instructions": optional({"type": "string"}),
        "max_output_tokens": optional({"type": "integer", "minimum": int(CHAT_MAX_TOKENS.low), "maximum": TOP}),
        "temperature": ranged("temperature"),
        "top_p": ranged("top_p"),
        "stream": optional({"type": "boolean"}),
        "priority": PRIORITY_SCHEMA,
        "tools": optional({"type": "array", "items": function}),
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, named, {"type": "null"}]},
        "parallel_tool_calls": optional({"type": "boolean"}),
        "text": optional({"type": "object", "properties": {"format": optional({"anyOf": [plain, json_schema]})}}),
        "previous_response_id": {"type": "null", "description": "unsupported: neuron stores no responses"},
        "reasoning": optional(
            {
                "type": "object",
                "properties": {"effort": {"enum": [*EFFORTS, None]} if reasons else {"type": "null"}},
                "description": "effort: as the chat's reasoning_effort; summary: accepted and ignored",
            }
        ),
    } | {name: {"description": "accepted and ignored"} for name in sorted(IGNORED)}
    properties["metadata"] = limits.METADATA_SCHEMA
    return {
        "type": "object",
        "required": ["model", "input"],
        "properties": properties,
        "additionalProperties": False,
        "allOf": rules,
    }


def reply(model_id: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "created_at": {"type": "integer"},
            "status": {"enum": ["completed", "incomplete"]},
            "model": {"enum": served_names(model_id)},
            "output": {
                "type": "array",
                "items": {"type": "object", "required": ["type"], "properties": {"type": {"enum": OUTPUT_TYPES}}},
            },
            "usage": {
                "type": "object",
                "required": ["input_tokens", "input_tokens_details", "output_tokens", "total_tokens"],
                "properties": {
                    **{k: COUNT for k in ("input_tokens", "output_tokens", "total_tokens")},
                    "input_tokens_details": {
                        "type": "object",
                        "required": ["cached_tokens", "cache_write_tokens"],
                        "properties": {"cached_tokens": COUNT, "cache_write_tokens": COUNT},
                    },
                },
            },
        },
    }


TOP = INT64[1]
COUNT = {"type": "integer", "minimum": 0}
OUTPUT_TYPES = ["reasoning", "message", "function_call"]
