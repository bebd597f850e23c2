"""The request bodies of ``/v1/chat/completions`` and ``/v1/completions`` as JSON Schema, for the OpenAPI document
(``schema``): every bound read from where the handlers' checks read it, so the two cannot drift apart."""

from __future__ import annotations

from typing import Any

from neuron.sampling_params import LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_STOPS, RANGES
from neuron.server import limits, tools
from neuron.server.openai_api import (
    CHAT_MAX_TOKENS,
    COMPLETION_UNSUPPORTED,
    IGNORED,
    INT64,
    MAX_COMPLETION_LOGPROBS,
    ROLES,
    UNSUPPORTED,
)

Schema = dict[str, Any]


def or_null(schema: Schema) -> Schema:
    """Every optional field also takes null, meaning "the default", as OpenAI's do."""
    return {"anyOf": [schema, {"type": "null"}]}


def integer(low: int = INT64[0], high: int = INT64[1]) -> Schema:
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
    return or_null(schema)


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
        "logit_bias": or_null(
            {
                "type": "object",
                "propertyNames": bias_keys,
                "additionalProperties": {"type": "number", **LOGIT_BIAS.json_schema()},
                "description": "token id (a decimal string) -> bias added to its logit",
            }
        ),
        "stop": or_null(
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOPS},
                ]
            }
        ),
        "n": or_null(
            {
                **integer(1, max_n or INT64[1]),
                "description": "choices per prompt, sampled independently from one computation of the prompt; "
                "with a seed, choice i draws with seed + i",
            }
        ),
        **_extension_properties(vocab_size),
        "stream": or_null({"type": "boolean"}),
        "stream_options": or_null({"type": "object", "properties": {"include_usage": or_null({"type": "boolean"})}}),
    }


def _passthrough(chat: bool) -> Schema:
    unsupported = {
        name: {"enum": [None, *neutral], "description": f"{reason}; only null or a neutral value is accepted"}
        for name, (reason, neutral) in (UNSUPPORTED if chat else COMPLETION_UNSUPPORTED).items()
    }
    ignored = {name: {"description": "accepted and ignored"} for name in sorted(IGNORED)}
    return {**unsupported, **ignored, "metadata": limits.METADATA_SCHEMA}


def _requires(field: str, kind: str, needs: str) -> Schema:
    """``field``, when given (not null), needs ``needs`` set to true."""
    return {
        "if": {"properties": {field: {"type": kind}}, "required": [field]},
        "then": {"properties": {needs: {"const": True}}, "required": [needs]},
    }


JSON_STRING = or_null({"type": "string", "description": "JSON"})
RESPONSE_FORMAT = or_null(
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
                            "description": or_null({"type": "string"}),
                            "schema": or_null({"type": "object"}),
                            "strict": or_null({"type": "boolean"}),
                        },
                    },
                },
            },
        ],
        "description": "json_object or json_schema: enforced while decoding; a schema the grammar engine cannot "
        "enforce is a 400 naming the keyword (code unsupported_schema)",
    }
)


def request(model_id: str, vocab_size: int | None, context: int | None, max_n: int | None, *, chat: bool) -> Schema:
    max_tokens = or_null(
        {
            **integer(int((CHAT_MAX_TOKENS if chat else RANGES["max_tokens"]).low)),
            "description": "tokens to generate; more than the context leaves after the prompt is cut to fit",
        }
    )
    properties: Schema = {"model": {"type": "string", "enum": [model_id]}, **_sampling_properties(vocab_size, max_n)}
    tokens: Schema = {"type": "array", "minItems": 1, "items": integer(0, (vocab_size or 2**63) - 1)}
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
                "content": or_null({"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}),
                "tool_calls": or_null(
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
                "tool_call_id": or_null({"type": "string"}),
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
            "logprobs": or_null({"type": "boolean"}),
            "top_logprobs": _ranged("logprobs", "integer"),
            "response_format": RESPONSE_FORMAT,
            **tools.request_properties(),
        }
        required = ["model", "messages"]
        rules = [
            _requires("stream_options", "object", "stream"),
            _requires("top_logprobs", "integer", "logprobs"),
            *tools.request_rules(),
            ONE_CONSTRAINED,
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
            "logprobs": or_null(integer(0, MAX_COMPLETION_LOGPROBS)),
            "echo": or_null(
                {"type": "boolean", "description": "the prompt before the completion; with logprobs, scored"}
            ),
            "response_format": RESPONSE_FORMAT,
        }
        required = ["model", "prompt"]
        rules = [_requires("stream_options", "object", "stream"), ONE_CONSTRAINED]
    return {
        "type": "object",
        "required": required,
        "properties": properties | _passthrough(chat),
        "additionalProperties": False,
        "allOf": rules,
    }


def _extension_properties(vocab_size: int | None) -> Schema:
    """vLLM's extensions (openai.EXTENSIONS), as vLLM defines them."""
    return {
        "ignore_eos": or_null({"type": "boolean", "description": "extension: generate past end-of-sequence"}),
        "min_tokens": {
            **or_null({"type": "integer", **RANGES["min_tokens"].json_schema(), "maximum": INT64[1]}),
            "description": "extension: end-of-sequence and stop_token_ids are held back until this many tokens; "
            "at most max_tokens (code min_tokens_above_max_tokens)",
        },
        "stop_token_ids": or_null(
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": (vocab_size or 2**63) - 1},
                "maxItems": MAX_STOP_TOKEN_IDS,
                "description": "extension: tokens that end the text (finish_reason stop), never part of it",
            }
        ),
        "include_stop_str_in_output": or_null({"type": "boolean", "description": "extension: keep the stop string"}),
        "skip_special_tokens": or_null(
            {"type": "boolean", "description": "extension: leave special tokens out of the text (default true)"}
        ),
        "num_draft_tokens": {
            **or_null({"type": "integer", **RANGES["num_draft_tokens"].json_schema()}),
            "description": "extension (mlx-lm's name): at most this many speculative draft tokens per step; 0: none",
        },
        "prediction": or_null(
            {
                "type": "object",
                "required": ["type", "content"],
                "properties": {
                    "type": {"enum": ["content"]},
                    "content": {
                        "anyOf": [
                            {"type": "string"},
                            {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["type", "text"],
                                    "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
                                },
                            },
                        ]
                    },
                },
                "description": "OpenAI's predicted output: its tokens are speculation's drafts; the text is unchanged",
            }
        ),
    }


# n > 1 copies one sequence's state, and a constraint follows one sequence's tokens: not both.
ONE_CONSTRAINED: Schema = {
    "not": {
        "required": ["n"],
        "properties": {"n": {"type": "integer", "minimum": 2}},
        "anyOf": [
            {
                "required": ["response_format"],
                "properties": {
                    "response_format": {
                        "type": "object",
                        "required": ["type"],
                        "properties": {"type": {"enum": ["json_object", "json_schema"]}},
                    }
                },
            },
            {
                "required": ["tool_choice"],
                "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
            },
        ],
    }
}
