"""OpenAI's request and response shapes: parse and check a body, build the replies. No MLX, no HTTP.

Every refusal is an ``ApiError`` naming the field (``param``) and saying what
would be accepted, in the body OpenAI uses, so a client's own error handling
works unchanged.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from neuron.engine.sequence import Chunk, Finish
from neuron.sampling_params import MAX_STOPS, MAX_TOP_LOGPROBS, RANGES, SamplingParams

MAX_COMPLETION_LOGPROBS = 5
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
    "prediction": ("predicted outputs are not supported", ()),
    "web_search_options": ("web search is not supported", ()),
    "reasoning_effort": ("reasoning controls are not supported", ()),
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
}
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
}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "max_tokens", "logprobs", "echo", "response_format"}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
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


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(slots=True)
class Generation:
    """A checked request: what to generate and how to answer."""

    chat: bool
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat
    prompt: str | list[int] = ""  # completions: text or token ids
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    schema: dict[str, Any] | None = None  # what the output must match (response_format)
    tools: Any = None  # server/tools.py's Tools, for a chat that may call them


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
    if _int(body, "n", 1) != 1:
        raise bad("n", "`n` must be 1: neuron returns one choice per request")

    gen = Generation(chat=chat, model=model)
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
        gen.prompt = _prompt(body.get("prompt"))
        max_tokens = _int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
        if _bool(body, "echo"):
            raise bad("echo", "`echo` is not supported by neuron", "unsupported_parameter")
        top_n = _int(body, "logprobs", None)
        if top_n is not None and not 0 <= top_n <= MAX_COMPLETION_LOGPROBS:
            raise bad("logprobs", f"`logprobs` must lie in [0, {MAX_COMPLETION_LOGPROBS}], got {top_n}")
        gen.logprobs = top_n is not None
    for name in ("max_tokens", "max_completion_tokens"):
        # Each field given is checked, the one overridden too; the limit itself is SamplingParams'.
        if (value := body.get(name)) is not None and not RANGES["max_tokens"].holds(value):
            raise bad(name, f"`{name}` {RANGES['max_tokens'].requirement}, got {value}")

    gen.stream = _bool(body, "stream")
    options = _get(body, "stream_options", "an object", lambda v: isinstance(v, dict), None)
    if options is not None:
        if not gen.stream:
            raise bad("stream_options", "`stream_options` is only allowed with `stream` set to true")
        gen.include_usage = _bool(options, "include_usage")
    gen.params = _sampling(body, top_n, max_tokens)
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
    for key, kind in (("description", str), ("strict", bool)):
        if spec.get(key) is not None and type(spec[key]) is not kind:
            where = f"response_format.json_schema.{key}"
            raise bad(where, f"`{where}` must be a {kind.__name__}")
    return schema or {}


def _sampling(body: dict[str, Any], top_logprobs: int | None, max_tokens: int | None) -> SamplingParams:
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
    )
    if problems := params.problems():
        param = problems[0].split(" ", 1)[0]
        raise bad(param, "; ".join(problems))
    return params


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
        try:
            parsed = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError:
            parsed = arguments  # the template gets it as it came
        out.append({**call, "function": {"name": function["name"], "arguments": parsed or {}}})
    return out


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if not isinstance(value, list):
        raise bad(where, f"`{where}` must be a string or an array of text parts, got {_kind(value)}")
    parts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else _kind(part)
            raise bad(f"{where}[{i}]", f"`{where}[{i}]` is a {kind!r} part; this model reads text parts only")
        parts.append(part["text"])
    return "".join(parts)


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise bad("prompt", "`prompt` is empty")
        return value
    if isinstance(value, list) and value and all(_is_int64(t) for t in value):
        return [int(t) for t in value]
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise bad("prompt", "`prompt` holds several prompts; send one per request")
    raise bad("prompt", f"`prompt` must be a string or an array of token ids, got {_kind(value)}")


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"`stop` must be a string or an array of strings, got {_kind(value)}")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"`stop` holds at most {MAX_STOPS} strings, got {len(stops)}")
    return tuple(s for s in stops if s)


# Replies.


def usage(finish: Finish) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` counts the prompt tokens the prefix cache restored."""
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finish.cached_tokens},
    }


class Replies:
    """Builds one request's reply objects, in the chat or the completions shape."""

    def __init__(self, gen: Generation, request_id: str, token_text: Callable[[int], str]) -> None:
        self.gen = gen
        self.id = request_id
        self.created = int(time.time())
        self.token_text = token_text
        self._offset = 0  # completions' text_offset

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.gen.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.gen.model}

    def logprobs(self, chunks: list[Chunk], text: str = "") -> dict[str, Any] | None:
        if not self.gen.logprobs:
            return None
        if self.gen.chat:
            return {"content": [self._chat_logprob(c) for c in chunks], "refusal": None}
        tokens = [self.token_text(c.token) for c in chunks]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [c.logprob for c in chunks],
            "top_logprobs": [{self.token_text(t): lp for t, lp in c.top} for c in chunks],
            "text_offset": offsets,
        }

    def _chat_logprob(self, chunk: Chunk) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {**entry(chunk.token, chunk.logprob), "top_logprobs": [entry(t, lp) for t, lp in chunk.top]}

    def choice(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None,
        *,
        delta: bool,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict:
        out: dict[str, Any] = {"index": 0}
        if not self.gen.chat:
            out["text"] = text
        elif delta:
            out["delta"] = {"content": text} if text or (finish_reason is None and not tool_calls) else {}
            if tool_calls:
                # One delta per call, each whole: a client's accumulation of argument pieces reads it the same.
                out["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        else:
            out["message"] = {"role": "assistant", "content": text or None if tool_calls else text, "refusal": None}
            if tool_calls:
                out["message"]["tool_calls"] = tool_calls
        out["logprobs"] = logprobs
        out["finish_reason"] = finish_reason
        return out

    def chunk(self, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {**self._envelope(chunk=True), "choices": choices}
        if self.gen.include_usage:
            out["usage"] = usage_
        return out

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role and no text."""
        if not self.gen.chat:
            return None
        return self.chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def whole(
        self,
        text: str,
        finish_reason: str,
        logprobs: dict | None,
        usage_: dict[str, Any],
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        return {
            **self._envelope(chunk=False),
            "choices": [self.choice(text, finish_reason, logprobs, delta=False, tool_calls=tool_calls)],
            "usage": usage_,
        }
