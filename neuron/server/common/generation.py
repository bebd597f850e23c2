"""A request to generate, as every generating family's body becomes one (``Generation``), and the checks they
share: which fields a body may hold, the model, ``n``, streaming, the sampling parameters and
``response_format``. Chat completions, responses and messages reach it through ``chat.parse``; completions
through ``completions.parse``. No MLX, no HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neuron.sampling_params import LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_STOPS, RANGES, Range, SamplingParams
from neuron.server.common import limits
from neuron.server.common.errors import bad, within_limits
from neuron.server.common.fields import (
    IGNORED,
    INT64,
    TOKEN_ID,
    an_object,
    flag,
    get,
    integer,
    is_int64,
    model,
    number,
    same,
    type_of,
)
from neuron.server.common.reasoning import Options
from neuron.server.common.schema import Schema, below, or_null, ranged
from neuron.server.common.schema import integer as integer_schema
from neuron.server.common.tools import Tools

CHAT_MAX_TOKENS = Range(1)
# Refused unless they hold a value that asks for nothing (null, or a neutral value
# below): silently ignoring them would change what the client gets.
UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "functions": ("the legacy `functions` is not supported; send `tools`", ([],)),
    "function_call": ("the legacy `function_call` is not supported; send `tool_choice`", ("none",)),
    "audio": ("audio output is not supported", ()),
    "modalities": ("only text output is supported", (["text"],)),
    "web_search_options": ("web search is not supported", ()),
    "verbosity": ("verbosity controls are not supported", ()),
    "best_of": ("best_of is not supported; send 1", (1,)),
    "suffix": ("suffix (insertion) is not supported", ("",)),
}
# vLLM's sampling extensions, which benchmark tools send (vLLM's `bench serve`, genai-perf); vLLM's names and meanings.
EXTENSIONS = ("ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens")
# OpenAI's predicted outputs (draft tokens for speculation), and mlx-lm's per-request cap on draft tokens.
SPECULATION = ("prediction", "num_draft_tokens")
SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "stop",
        "n",
        "stream",
        "stream_options",
        "model",
        "priority",
        *EXTENSIONS,
        *SPECULATION,
    }
)
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# A request's ``priority`` (vLLM's field: lower is sooner), bounded as a signed 32-bit integer.
PRIORITY = (-(2**31), 2**31 - 1)


@dataclass(slots=True)
class Generation:
    """A checked request: what to generate and how to answer."""

    chat: bool
    model: str
    adapter: str | None = None  # the LoRA adapter ``model`` names; None: the base model
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: each text or token ids
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt comes back before the completion (scored, with logprobs)
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    schema: dict[str, Any] | None = None  # what the output must match (response_format)
    tools: Tools | None = None  # for a chat that may call them
    reasoning: Options | None = None  # for a chat
    priority: int = 0  # where it waits under ``--scheduling-policy priority``: lower is sooner


def begin(
    body: Any,
    *,
    chat: bool,
    served_model: str,
    allowed: frozenset[str],
    unsupported: dict[str, tuple[str, tuple[Any, ...]]],
) -> Generation:
    """The checks every OpenAI-shaped body starts with: its fields, ``metadata``, ``model`` and ``n``."""
    body = an_object(body)
    for name, value in body.items():
        if name in unsupported:
            reason, neutral = unsupported[name]
            if value is not None and not any(same(value, n) for n in neutral):
                raise bad(name, f"`{name}`: {reason} by neuron", "unsupported_parameter")
        elif name not in allowed and name not in IGNORED:
            raise bad(name, f"unrecognized request argument `{name}`", "unknown_parameter")
    within_limits(limits.check_metadata, body.get("metadata"))
    gen = Generation(chat=chat, model=model(body, served_model), n=integer(body, "n", 1))
    gen.adapter = gen.model if gen.model != served_model else None
    if gen.n < 1:
        raise bad("n", f"`n` must be at least 1, got {gen.n}")
    gen.priority = integer(body, "priority", 0)
    if not PRIORITY[0] <= gen.priority <= PRIORITY[1]:
        raise bad(
            "priority", f"`priority` must lie in [{PRIORITY[0]}, {PRIORITY[1]}] (lower is sooner), got {gen.priority}"
        )
    return gen


def finish(
    gen: Generation, body: dict[str, Any], limit: Range, top_n: int | None, max_tokens: int | None
) -> Generation:
    """The checks every OpenAI-shaped body ends with: its token limits (each within ``limit``), streaming, the
    sampling parameters (``top_n`` logprobs per token) and ``response_format``."""
    for name in ("max_tokens", "max_completion_tokens"):
        # Each field given is checked, the one overridden too.
        if (value := body.get(name)) is not None and not limit.holds(value):
            raise bad(name, f"`{name}` {limit.requirement}, got {value}")
    gen.stream = flag(body, "stream")
    options = get(body, "stream_options", "an object", lambda v: isinstance(v, dict), None)
    if options is not None:
        if not gen.stream:
            raise bad("stream_options", "`stream_options` is only allowed with `stream` set to true")
        gen.include_usage = flag(options, "include_usage")
    gen.params = _sampling(body, top_n, max_tokens, top_n if gen.echo else None)
    gen.schema = _response_format(body.get("response_format"))
    return gen


def _response_format(value: Any) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks the output to match; None for plain text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise bad("response_format", f"`response_format.type` must be one of {', '.join(RESPONSE_FORMATS)}")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "text":
        return None
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad(
            "response_format.json_schema",
            "`response_format.json_schema` must be an object with a `name` and a `schema` (a JSON schema)",
        )
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", "`response_format.json_schema.schema` must be an object")
    if schema is not None:
        # Named `response_format` as OpenAI names a schema's problems, and as the grammar's refusals are.
        within_limits(limits.check_schema, schema, "response_format.json_schema.schema", "response_format")
    for key, kind in (("description", str), ("strict", bool)):
        if spec.get(key) is not None and type(spec[key]) is not kind:
            where = f"response_format.json_schema.{key}"
            raise bad(where, f"`{where}` must be a {kind.__name__}")
    return schema or {}


def _prediction(value: Any) -> str:
    """OpenAI's ``{"type": "content", "content": text or [{"type": "text", "text": ...}]}``; its text."""
    if value is None:
        return ""
    content = value.get("content") if isinstance(value, dict) and value.get("type") == "content" else None
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad("prediction", '`prediction` is {"type": "content", "content": text or text parts}')
    return content


def _sampling(
    body: dict[str, Any], top_logprobs: int | None, max_tokens: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    bias = get(body, "logit_bias", "an object", lambda v: isinstance(v, dict), {})
    logit_bias: dict[int, float] = {}
    for key, value in bias.items():
        if not TOKEN_ID.fullmatch(key) or type(value) not in (int, float):
            raise bad("logit_bias", "`logit_bias` maps token ids (as strings) to numbers in [-100, 100]")
        logit_bias[int(key)] = float(value)
    seed = integer(body, "seed", None)
    params = SamplingParams(
        max_tokens=max_tokens,
        stop=_stops(body.get("stop")),
        temperature=number(body, "temperature", 1.0),
        top_p=number(body, "top_p", 1.0),
        top_k=integer(body, "top_k", 0),
        min_p=number(body, "min_p", 0.0),
        seed=seed,
        presence_penalty=number(body, "presence_penalty", 0.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0),
        repetition_penalty=number(body, "repetition_penalty", 1.0),
        logit_bias=logit_bias,
        logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        ignore_eos=flag(body, "ignore_eos"),
        min_tokens=integer(body, "min_tokens", 0),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        include_stop_str_in_output=flag(body, "include_stop_str_in_output"),
        skip_special_tokens=flag(body, "skip_special_tokens", True),
        num_draft_tokens=integer(body, "num_draft_tokens", None),
        prediction=_prediction(body.get("prediction")),
    )
    if problems := params.problems():
        param = problems[0].split(" ", 1)[0]
        # Of two fields together, which no JSON schema states: schemathesis's hook lets this code through.
        above = problems[0].startswith("min_tokens must be at most")
        code = "min_tokens_above_max_tokens" if above else "invalid_value"
        raise bad(param, "; ".join(problems), code)
    return params


def _token_ids(body: dict[str, Any], name: str) -> tuple[int, ...]:
    ids = get(body, name, "an array of token ids", lambda v: isinstance(v, list) and all(map(is_int64, v)), [])
    return tuple(int(t) for t in ids)


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"`stop` must be a string or an array of strings, got {type_of(value)}")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"`stop` holds at most {MAX_STOPS} strings, got {len(stops)}")
    return tuple(s for s in stops if s)


# The OpenAPI pieces of these checks, beside them: the fields chat completions and completions share.


def _nullable(name: str, kind: str) -> Schema:
    """A sampling field of ``kind`` within its ``RANGES`` bounds, or null."""
    return or_null(ranged(name, kind))


def max_tokens(limit: Range) -> Schema:
    return or_null(
        {
            **integer_schema(int(limit.low)),
            "description": "tokens to generate; more than the context leaves after the prompt, or than the "
            "server's --max-completion-tokens, is cut to fit",
        }
    )


def sampling_properties(vocab_size: int | None, max_n: int | None) -> Schema:
    bias_keys: Schema = {"pattern": below(vocab_size)} if vocab_size else {"pattern": "^[0-9]+$"}
    return {
        "temperature": _nullable("temperature", "number"),
        "top_p": _nullable("top_p", "number"),
        "top_k": _nullable("top_k", "integer"),
        "min_p": _nullable("min_p", "number"),
        "seed": _nullable("seed", "integer"),
        "presence_penalty": _nullable("presence_penalty", "number"),
        "frequency_penalty": _nullable("frequency_penalty", "number"),
        "repetition_penalty": _nullable("repetition_penalty", "number"),
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
                **integer_schema(1, max_n or INT64[1]),
                "description": "choices per prompt, sampled independently from one computation of the prompt; "
                "with a seed, choice i draws with seed + i",
            }
        ),
        **_extension_properties(vocab_size),
        "stream": or_null({"type": "boolean"}),
        "stream_options": or_null({"type": "object", "properties": {"include_usage": or_null({"type": "boolean"})}}),
        "priority": PRIORITY_SCHEMA,
    }


PRIORITY_SCHEMA: Schema = or_null(
    {
        **integer_schema(*PRIORITY),
        "description": "extension (vLLM's): where the request waits under --scheduling-policy priority; lower is "
        "sooner, 0 by default",
    }
)


def passthrough(unsupported: dict[str, tuple[str, tuple[Any, ...]]]) -> Schema:
    """The fields accepted only with a neutral value, and those accepted and ignored."""
    neutral_only = {
        name: {"enum": [None, *neutral], "description": f"{reason}; only null or a neutral value is accepted"}
        for name, (reason, neutral) in unsupported.items()
    }
    ignored = {name: {"description": "accepted and ignored"} for name in sorted(IGNORED)}
    return {**neutral_only, **ignored, "metadata": limits.METADATA_SCHEMA}


def requires(field: str, kind: str, needs: str) -> Schema:
    """``field``, when given (not null), needs ``needs`` set to true."""
    return {
        "if": {"properties": {field: {"type": kind}}, "required": [field]},
        "then": {"properties": {needs: {"const": True}}, "required": [needs]},
    }


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


def _extension_properties(vocab_size: int | None) -> Schema:
    """vLLM's extensions (EXTENSIONS), as vLLM defines them."""
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
