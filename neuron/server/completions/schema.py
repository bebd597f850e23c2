"""``POST /v1/completions`` in the OpenAPI document: its body, every bound read from where the checks read it,
and its reply (``Completion``). No MLX.
"""

from __future__ import annotations

from neuron.sampling_params import RANGES
from neuron.server.common.choices import CHOICE_BASE, envelope
from neuron.server.common.generation import (
    ONE_CONSTRAINED,
    RESPONSE_FORMAT,
    max_tokens,
    passthrough,
    requires,
    sampling_properties,
)
from neuron.server.common.schema import Schema, Spec, integer, or_null, served_names, token_ids
from neuron.server.completions.parse import COMPLETION_UNSUPPORTED, DEFAULT_MAX_TOKENS, MAX_LOGPROBS


def request(spec: Spec) -> Schema:
    context = spec.context
    tokens: Schema = {"type": "array", "minItems": 1, "items": token_ids(spec.vocab_size)}
    if context:
        tokens["maxItems"] = context - 1
    note = f"at most {context - 1} tokens" if context else "shorter than the model's context"
    text = {"type": "string", "minLength": 1}
    properties: Schema = {
        "model": {"type": "string", "enum": served_names(spec.model_id)},
        **sampling_properties(spec.vocab_size, spec.max_n),
        "prompt": {
            "anyOf": [text, tokens, {"type": "array", "minItems": 1, "items": {"anyOf": [text, tokens]}}],
            "description": f"text or token ids ({note}), or a list of them: a choice per prompt",
        },
        "max_tokens": {**max_tokens(RANGES["max_tokens"]), "default": DEFAULT_MAX_TOKENS},
        "logprobs": or_null(integer(0, MAX_LOGPROBS)),
        "echo": or_null({"type": "boolean", "description": "the prompt before the completion; with logprobs, scored"}),
        "response_format": RESPONSE_FORMAT,
    }
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": properties | passthrough(COMPLETION_UNSUPPORTED),
        "additionalProperties": False,
        "allOf": [requires("stream_options", "object", "stream"), ONE_CONSTRAINED],
    }


def reply(model_id: str) -> Schema:
    """``Completion``."""
    logprobs = or_null(
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
    choice = {
        "type": "object",
        "required": ["index", "text", "logprobs", "finish_reason"],
        "properties": {**CHOICE_BASE, "text": {"type": "string"}, "logprobs": logprobs},
    }
    return envelope(model_id, "text_completion", choice)
