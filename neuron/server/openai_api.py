"""OpenAI's request and response shapes: parse and check a body, build the replies. No MLX, no HTTP.

Every refusal is an ``ApiError`` naming the field (``param``) and saying what
would be accepted, in the body OpenAI uses, so a client's own error handling
works unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from neuron import images
from neuron.engine.sequence import Failure
from neuron.sampling_params import MAX_STOPS, MAX_TOP_LOGPROBS, RANGES, Range, SamplingParams
from neuron.server import limits

MAX_COMPLETION_LOGPROBS = 5
CHAT_MAX_TOKENS = Range(1)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left

# Accepted and ignored: they change nothing about what a single server generates.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})
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
# Tools are the chat route's; the completions route takes only their neutral values, as it always did.
COMPLETION_UNSUPPORTED = {
    **UNSUPPORTED,
    "tools": ("tools need /v1/chat/completions", ([],)),
    "tool_choice": ("tools need /v1/chat/completions", ("none",)),
    "parallel_tool_calls": ("tools need /v1/chat/completions", (True, False)),
    "reasoning_effort": ("reasoning controls need /v1/chat/completions", ()),
}
# vLLM's sampling extensions, which benchmark tools send (vLLM's `bench serve`, genai-perf); vLLM's names and meanings.
EXTENSIONS = ("ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens")
# OpenAI's predicted outputs (draft tokens for speculation), and mlx-lm's per-request cap on draft tokens.
SPECULATION = ("prediction", "num_draft_tokens")
INT64 = (-(2**63), 2**63 - 1)  # what JSON parsers on both ends agree an integer can be
TOKEN_ID = re.compile(r"[0-9]+")
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
        *EXTENSIONS,
        *SPECULATION,
    }
)
CHAT_FIELDS = SAMPLING_FIELDS | {
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",  # read by server/tools.py
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",  # read by server/reasoning.py
    "include_reasoning",
    "reasoning_effort",
}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "max_tokens", "logprobs", "echo", "response_format"}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
T = TypeVar("T")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class ApiError(Exception):
    """An HTTP error with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_ready(message: str, retry_after: int = 1) -> ApiError:
    """503 with Retry-After, so that clients (the OpenAI SDKs among them) come back rather than give up."""
    return ApiError(503, message, type="server_error", code="not_ready", headers={"retry-after": str(retry_after)})


def failure_error(failure: Failure) -> ApiError:
    if failure.kind == "unavailable":
        # A lost group (the leader restarts) or a failed probe (the next comes in 5 s): seconds either way.
        return not_ready(failure.message, retry_after=5)
    if failure.kind == "constraint":
        # This request's grammar alone failed; the rest of the batch went on.
        return ApiError(500, failure.message, type="server_error", code="constraint_failed")
    return ApiError(500, failure.message, type="server_error", code="step_failed")


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def within_limits(check: Callable[..., T], *args: Any) -> T:
    """``check(*args)``, a bound of ``limits`` passed answered as OpenAI's 400."""
    try:
        return check(*args)
    except limits.LimitError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None


@dataclass(slots=True)
class Generation:
    """A checked request: what to generate and how to answer."""

    chat: bool
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: each text or token ids
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt comes back before the completion (scored, with logprobs)
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    schema: dict[str, Any] | None = None  # what the output must match (response_format)
    tools: Any = None  # server/tools.py's Tools, for a chat that may call them
    reasoning: Any = None  # server/reasoning.py's Options, for a chat


# Typed reads of one field. JSON has one number type; Python's bool is an int, so it is refused explicitly.


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _get(body: dict[str, Any], name: str, expected: str, check: Callable[[Any], bool], default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad(name, f"`{name}` must be {expected}, got {_kind(value)}", "invalid_type")
    return value


def _same(a: Any, b: Any) -> bool:
    """JSON equality that tells true from 1."""
    return type(a) is type(b) and a == b


def _is_int64(value: Any) -> bool:
    # JSON Schema counts 2.0 as an integer, and so do we.
    whole = type(value) is int or (type(value) is float and value.is_integer())
    return whole and INT64[0] <= value <= INT64[1]


def _int(body: dict[str, Any], name: str, default: int | None = None) -> Any:
    value = _get(body, name, "a 64-bit integer", _is_int64, default)
    return value if value is None else int(value)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    return float(_get(body, name, "a number", lambda v: type(v) in (int, float), default))


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    return _get(body, name, "a boolean", lambda v: type(v) is bool, default)


def parse(body: Any, *, chat: bool, served_model: str) -> Generation:
    """Check a chat or completions body; raise ``ApiError`` naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_kind(body)}", code="invalid_body")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unsupported = UNSUPPORTED if chat else COMPLETION_UNSUPPORTED
    for name, value in body.items():
        if name in unsupported:
            reason, neutral = unsupported[name]
            if value is not None and not any(_same(value, n) for n in neutral):
                raise bad(name, f"`{name}`: {reason} by neuron", "unsupported_parameter")
        elif name not in allowed and name not in IGNORED:
            raise bad(name, f"unrecognized request argument `{name}`", "unknown_parameter")

    within_limits(limits.check_metadata, body.get("metadata"))
    model = _get(body, "model", "a string", lambda v: isinstance(v, str), None)
    if model is None:
        raise bad("model", "`model` is required; GET /v1/models lists the one served", "missing_required_parameter")
    if model != served_model:
        raise ApiError(
            404,
            f"the model `{model}` does not exist; this server serves `{served_model}`",
            param="model",
            code="model_not_found",
        )
    gen = Generation(chat=chat, model=model, n=_int(body, "n", 1))
    if gen.n < 1:
        raise bad("n", f"`n` must be at least 1, got {gen.n}")
    if chat:
        gen.messages = _messages(body.get("messages"))
        # Both are checked; the newer name wins.
        legacy = _int(body, "max_tokens", None)
        max_tokens = _int(body, "max_completion_tokens", legacy)
        gen.logprobs = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", None)
        if top is not None and not gen.logprobs:
            raise bad("top_logprobs", "`top_logprobs` needs `logprobs` set to true")
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"`top_logprobs` must lie in [0, {MAX_TOP_LOGPROBS}], got {top}")
        top_n = (top or 0) if gen.logprobs else None
    else:
        gen.prompts = _prompts(body.get("prompt"))
        max_tokens = _int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
        gen.echo = _bool(body, "echo")
        top_n = _int(body, "logprobs", None)
        if top_n is not None and not 0 <= top_n <= MAX_COMPLETION_LOGPROBS:
            raise bad("logprobs", f"`logprobs` must lie in [0, {MAX_COMPLETION_LOGPROBS}], got {top_n}")
        gen.logprobs = top_n is not None
    # Only completions can ask for no tokens: the prompt, scored (echo).
    limit = CHAT_MAX_TOKENS if chat else RANGES["max_tokens"]
    for name in ("max_tokens", "max_completion_tokens"):
        # Each field given is checked, the one overridden too.
        if (value := body.get(name)) is not None and not limit.holds(value):
            raise bad(name, f"`{name}` {limit.requirement}, got {value}")

    gen.stream = _bool(body, "stream")
    options = _get(body, "stream_options", "an object", lambda v: isinstance(v, dict), None)
    if options is not None:
        if not gen.stream:
            raise bad("stream_options", "`stream_options` is only allowed with `stream` set to true")
        gen.include_usage = _bool(options, "include_usage")
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
    bias = _get(body, "logit_bias", "an object", lambda v: isinstance(v, dict), {})
    logit_bias: dict[int, float] = {}
    for key, value in bias.items():
        if not TOKEN_ID.fullmatch(key) or type(value) not in (int, float):
            raise bad("logit_bias", "`logit_bias` maps token ids (as strings) to numbers in [-100, 100]")
        logit_bias[int(key)] = float(value)
    seed = _int(body, "seed", None)
    params = SamplingParams(
        max_tokens=max_tokens,
        stop=_stops(body.get("stop")),
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=_int(body, "top_k", 0),
        min_p=_number(body, "min_p", 0.0),
        seed=seed,
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        logit_bias=logit_bias,
        logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=_int(body, "min_tokens", 0),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        num_draft_tokens=_int(body, "num_draft_tokens", None),
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
    ids = _get(body, name, "an array of token ids", lambda v: isinstance(v, list) and all(map(_is_int64, v)), [])
    return tuple(int(t) for t in ids)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad(
            "messages", f"`messages` must be an array of messages, got {_kind(value)}", "missing_required_parameter"
        )
    if not value:
        raise bad("messages", "`messages` is empty: send at least one message")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"`{where}` must be an object with `role` and `content`, got {_kind(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(f"{where}.role", f"`{where}.role` must be one of {', '.join(ROLES)}, got {role!r}")
        entry: dict[str, Any] = {"role": ROLES[role], "content": _content(message.get("content"), f"{where}.content")}
        if message.get("tool_calls") is not None:
            calls = _message_calls(message["tool_calls"], f"{where}.tool_calls")
            if role == "assistant" and calls:
                entry["tool_calls"] = calls
        if (call_id := message.get("tool_call_id")) is not None:
            if not isinstance(call_id, str):
                raise bad(f"{where}.tool_call_id", f"`{where}.tool_call_id` must be a string")
            entry["tool_call_id"] = call_id
        out.append(entry)
    try:
        images.check_count(out)
    except images.ImageError as e:
        raise bad(e.param, str(e)) from e
    return out


def _message_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier ``tool_calls``, checked; arguments parsed back to objects for templates."""
    if not isinstance(value, list):
        raise bad(where, f"`{where}` must be an array of tool calls")
    out = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"{where}[{i}]", f"`{where}[{i}]` must be {{id, type: function, function: {{name, arguments}}}}")
        if arguments is not None and not isinstance(arguments, str):
            raise bad(f"{where}[{i}].function.arguments", f"`{where}[{i}].function.arguments` must be a JSON string")
        # Not JSON: the template gets it as it came.
        parsed = (
            within_limits(limits.tool_call_arguments, arguments, f"{where}[{i}].function.arguments")
            if arguments
            else {}
        )
        out.append({**call, "function": {"name": function["name"], "arguments": parsed or {}}})
    return out


def _content(value: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if not isinstance(value, list):
        raise bad(where, f"`{where}` must be a string or an array of text parts, got {_kind(value)}")
    parts: list[str | dict[str, Any]] = []
    for i, part in enumerate(value):
        if isinstance(part, dict) and part.get("type") == "image_url":
            try:
                parts.append(images.part(part.get("image_url"), f"{where}[{i}]"))
            except images.ImageError as e:
                raise bad(e.param, str(e)) from e
            continue
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else _kind(part)
            raise bad(f"{where}[{i}]", f"`{where}[{i}]` is a {kind!r} part; this model reads text parts only")
        parts.append(part["text"])
    return images.joined(parts)


def _prompts(value: Any, name: str = "prompt") -> list[str | list[int]]:
    """One prompt (text or token ids) or a list of them; OpenAI's four shapes (the embeddings' ``input`` too)."""
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        return [_prompt(p, f"{name}[{i}]") for i, p in enumerate(value)]
    return [_prompt(value, name)]


def _prompt(value: Any, where: str) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise bad(where, f"`{where}` is empty")
        return value
    if isinstance(value, list) and value and all(_is_int64(t) for t in value):
        return [int(t) for t in value]
    raise bad(where, f"`{where}` must be a string or an array of token ids, got {_kind(value)}")


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"`stop` must be a string or an array of strings, got {_kind(value)}")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"`stop` holds at most {MAX_STOPS} strings, got {len(stops)}")
    return tuple(s for s in stops if s)
