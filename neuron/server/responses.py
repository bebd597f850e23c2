"""OpenAI's Responses API (``POST /v1/responses``): a body read as a chat, and the reply in the Responses shape,
whole or as its stream of typed events. No MLX, no HTTP.

Why a translation and not a route of its own all the way down: a Responses request is a chat (instructions,
messages, function calls and their outputs, tools) under other names. Turned into a chat body, it goes
through the chat route's checks, template and tool reading unchanged; only the names in errors and the reply
objects are this module's.

Stateless: no response is stored, so ``previous_response_id`` is refused; ``store`` is accepted and ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from neuron import images
from neuron.engine.sequence import Chunk, Finish, Sequence
from neuron.sampling_params import RANGES
from neuron.server import limits
from neuron.server.openai_api import (
    CHAT_MAX_TOKENS,
    IGNORED,
    INT64,
    ApiError,
    Generation,
    _kind,
    bad,
    failure_error,
    within_limits,
)
from neuron.server.reasoning import EFFORTS, ReasoningSplit
from neuron.server.tools import NAME, ToolStream, end, request_rules

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
PASSED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls")
FIELDS = frozenset({*PASSED, "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning"})
# Chat names in errors raised by the chat route's checks, as this route calls them.
RENAMED = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


def to_chat(body: Any) -> dict[str, Any]:
    """A Responses body as the chat body that asks for the same; ``ApiError`` naming this route's fields."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_kind(body)}", code="invalid_body")
    for name in body:
        if name == "previous_response_id" and body[name] is not None:
            message = "neuron stores no responses: send the whole conversation in `input` instead"
            raise bad(name, message, "unsupported_parameter")
        if name not in FIELDS and name not in IGNORED and name != "previous_response_id":
            raise bad(name, f"unrecognized request argument `{name}`", "unknown_parameter")
    within_limits(limits.check_metadata, body.get("metadata"))  # echoed in the reply
    chat = {name: body[name] for name in PASSED if name in body}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", f"`instructions` must be a string, got {_kind(instructions)}", "invalid_type")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions is not None else []) + _input(
        body.get("input")
    )
    if "max_output_tokens" in body:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if (choice := body.get("tool_choice")) is not None:
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            choice = {"type": "function", "function": {"name": choice["name"]}}
        elif choice not in ("none", "auto", "required"):
            raise bad("tool_choice", '`tool_choice` must be "none", "auto", "required" or {type: function, name}')
        chat["tool_choice"] = choice
    if (text := body.get("text")) is not None:
        chat["response_format"] = _format(text)
    if (reasoning := body.get("reasoning")) is not None:
        if not isinstance(reasoning, dict):
            raise bad("reasoning", f"`reasoning` must be an object with an `effort`, got {_kind(reasoning)}")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]  # checked, and named, by the chat route
    return chat


def renamed(error: ApiError) -> ApiError:
    """An error of the chat route's checks, with this route's field names."""
    if error.param is None:
        return error
    head = error.param.split("[", 1)[0].split(".", 1)[0]
    nested = "response_format.json_schema."
    if head == "tools":  # a chat tool's `function` is this route's tool itself
        param = error.param.replace(".function.", ".", 1)
    elif error.param.startswith(nested):  # this route's format is the json_schema object itself
        param = "text.format." + error.param.removeprefix(nested)
    elif head in RENAMED:
        param = RENAMED[head] if head == "messages" else RENAMED[head] + error.param[len(head) :]
    else:
        return error
    message = error.message.replace(f"`{nested}", "`text.format.").replace(f"`{error.param}`", f"`{param}`")
    message = message.replace(f"`{head}", f"`{RENAMED.get(head, head)}")
    return ApiError(error.status, message, type=error.type, param=param, code=error.code, headers=error.headers)


def _input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", "`input` must be a string or a non-empty array of items", "missing_required_parameter")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append({"role": _role(item, where), "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call: dict[str, Any] = {"id": _string(item, "call_id", where), "type": "function"}
            call["function"] = {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = _string(item, "call_id", where), _string(item, "output", where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise bad(where, f"`{where}` must be a message, a function_call or a function_call_output item")
    return out


def _role(item: dict[str, Any], where: str) -> str:
    role = item.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"`{where}.role` must be one of {', '.join(ROLES)}, got {role!r}")
    return role


def _string(item: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(value := item.get(key), str):
        raise bad(f"{where}.{key}", f"`{where}.{key}` must be a string, got {_kind(value)}")
    return value


def _text(value: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(where, f"`{where}` must be a string or an array of text parts, got {_kind(value)}")
    parts: list[str | dict[str, Any]] = []
    for i, part in enumerate(value):
        if (image := images.from_responses(part)) is not None:
            parts.append(image)
            continue
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad(f"{where}[{i}]", f"`{where}[{i}]` must be an input_text or output_text part")
        parts.append(part["text"])
    return images.joined(parts)


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad("tools", "`tools` must be an array of {type: function, name, parameters}")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f"tools[{i}]", f"`tools[{i}]` must be {{type: function, name, parameters}}: function tools only")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _format(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, dict):
        raise bad("text", f"`text` must be an object with a `format`, got {_kind(text)}")
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("text.format", "`text.format.type` must be text, json_object or json_schema")
    if spec["type"] != "json_schema":
        return {"type": spec["type"]}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if k != "type"}}


# Replies.


class ResponseReplies:
    """One request's Response object and stream events."""

    def __init__(
        self, gen: Generation, body: dict[str, Any], request_id: str, split: ReasoningSplit | None = None
    ) -> None:
        self.gen = gen
        self.body = body
        self.id = request_id
        self.created = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.split = split  # a thinking model's: its reasoning becomes a `reasoning` item before the message
        self.message_index = 0  # the message's place in `output`: 1 after a reasoning item
        self._sequence = 0

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, reason: str | None = None
    ) -> dict[str, Any]:
        body = self.body
        tools = [t for t in body.get("tools") or []]
        incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.gen.model,
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
            "tools": tools,
            "text": body.get("text") or {"format": {"type": "text"}},
            "store": False,
            "metadata": body.get("metadata") or {},
            "usage": usage,
        }

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [self.part(text)] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def calls(tool_calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        return [
            {
                "type": "function_call",
                "id": f"fc_{call['id'].removeprefix('call_')}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
            for call in tool_calls or []
        ]

    def reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content, "status": status}

    def output(self, text: str, tool_calls: list[dict[str, Any]] | None, thought: str = "") -> list[dict[str, Any]]:
        """The reasoning (if any), a message with the text (unless only calls came back), then each call."""
        reasoning = [self.reasoning(thought)] if thought else []
        return reasoning + ([self.message(text)] if text or not tool_calls else []) + self.calls(tool_calls)

    def split_text(self, text: str, last: bool = False) -> tuple[str, str]:
        """(reasoning, answer) of one token's text, or of the last text."""
        if self.split is None:
            return "", text
        return self.split.end(text) if last else self.split.push(text)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def text_item(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event about the message's one text part."""
        return self.event(kind, item_id=self.message_id, output_index=self.message_index, content_index=0, **fields)

    def reasoning_item(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event about the reasoning item's one text part."""
        return self.event(kind, item_id=self.reasoning_id, output_index=0, content_index=0, **fields)


def usage(finish: Finish, reasoning_tokens: int = 0) -> dict[str, Any]:
    prompt_tokens, completion_tokens = finish.prompt_tokens, finish.completion_tokens
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": finish.cached_tokens},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(event: dict[str, Any]) -> bytes:
    """The Responses stream names each event's type on an ``event:`` line too, as OpenAI's does."""
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event).encode() + b"\n\n"


async def collect(seq: Sequence, replies: ResponseReplies, reader: ToolStream | None) -> dict[str, Any]:
    texts = []
    async for event in seq.events:
        if isinstance(event, Chunk):
            texts.append(event.text)
        elif isinstance(event, Finish):
            split = replies.split
            thought, answer = split.whole(texts, event.text) if split else ("", "".join(texts) + event.text)
            text, calls, reason = end(reader, answer, event.reason)
            counts = usage(event, split.tokens if split else 0)
            return replies.response("completed", replies.output(text, calls, thought), counts, reason)
        else:
            raise failure_error(event)
    raise ApiError(500, "the engine ended the request without an answer", type="server_error")


async def events(seq: Sequence, replies: ResponseReplies, reader: ToolStream | None) -> AsyncGenerator[bytes]:
    """OpenAI's event order: created, in_progress, the message's item and part opened, text deltas, each closed,
    then any function calls as whole items, then completed (or incomplete) with the whole response."""
    started = replies.response("in_progress", [], None)
    yield sse(replies.event("response.created", response=started))
    yield sse(replies.event("response.in_progress", response=started))
    opened = False
    texts: list[str] = []
    thoughts: list[str] = []  # the reasoning item's text, while it is open (until the answer begins)

    def open_message() -> Iterator[bytes]:
        item = replies.message("", "in_progress")
        yield sse(replies.event("response.output_item.added", output_index=replies.message_index, item=item))
        yield sse(replies.text_item("response.content_part.added", part=replies.part("")))

    def close_reasoning() -> Iterator[bytes]:
        thought = "".join(thoughts)
        yield sse(replies.reasoning_item("response.reasoning_text.done", text=thought))
        yield sse(replies.event("response.output_item.done", output_index=0, item=replies.reasoning(thought)))
        replies.message_index = 1

    async for event in seq.events:
        if isinstance(event, Chunk):
            thought, answer = replies.split_text(event.text)
            text = reader.push(answer) if reader else answer
        elif isinstance(event, Finish):
            thought, answer = replies.split_text(event.text, last=True)
            text, calls, reason = end(reader, answer, event.reason)
        else:
            error = failure_error(event)
            yield sse(replies.event("error", code=error.code, message=error.message, param=None))
            return
        if thought and not opened:
            # Reasoning after the answer began (a model opening a second section) stays out of the stream.
            if not thoughts:
                item = replies.reasoning("", "in_progress")
                yield sse(replies.event("response.output_item.added", output_index=0, item=item))
            thoughts.append(thought)
            yield sse(replies.reasoning_item("response.reasoning_text.delta", delta=thought))
        if (text or isinstance(event, Finish)) and thoughts and replies.message_index == 0:
            for data in close_reasoning():
                yield data
        if text:
            if not opened:
                opened = True
                for data in open_message():
                    yield data
            texts.append(text)
            yield sse(replies.text_item("response.output_text.delta", delta=text, logprobs=[]))
        if isinstance(event, Finish):
            break
    else:
        message = "the engine ended the request without an answer"
        yield sse(replies.event("error", code="server_error", message=message, param=None))
        return
    whole = "".join(texts)
    if opened or not calls:
        if not opened:
            for data in open_message():
                yield data
        yield sse(replies.text_item("response.output_text.done", text=whole, logprobs=[]))
        yield sse(replies.text_item("response.content_part.done", part=replies.part(whole)))
        yield sse(
            replies.event("response.output_item.done", output_index=replies.message_index, item=replies.message(whole))
        )
    output = replies.output(whole, calls, "".join(thoughts))
    first_call = len(output) - len(calls or [])
    for index, item in enumerate(output[first_call:], first_call):
        yield sse(
            replies.event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
        )
        where = {"item_id": item["id"], "output_index": index}
        yield sse(replies.event("response.function_call_arguments.delta", **where, delta=item["arguments"]))
        yield sse(replies.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        yield sse(replies.event("response.output_item.done", output_index=index, item=item))
    final = replies.response("completed", output, usage(event, replies.split.tokens if replies.split else 0), reason)
    yield sse(replies.event(f"response.{final['status']}", response=final))


# The OpenAPI pieces of this route, beside the checks they describe.


def request_schema(model_id: str, reasons: bool = True) -> dict[str, Any]:
    def optional(schema: dict[str, Any]) -> dict[str, Any]:
        return {"anyOf": [schema, {"type": "null"}]}

    def ranged(name: str) -> dict[str, Any]:
        return optional({"type": "number", **RANGES[name].json_schema()})

    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"enum": list(TEXT_PARTS)}, "text": {"type": "string"}},
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "type": {"const": "message"},
            "role": {"enum": list(ROLES)},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]},
        },
    }

    def item(kind: str, *strings: str) -> dict[str, Any]:
        properties = {"type": {"const": kind}} | {s: {"type": "string"} for s in strings}
        return {"type": "object", "required": ["type", *strings], "properties": properties}

    function = {
        "type": "object",
        "required": ["type", "name"],
        "properties": {
            "type": {"const": "function"},
            "name": {"type": "string", "pattern": f"^{NAME.pattern}$"},
            "description": {"type": ["string", "null"]},
            "parameters": {"type": ["object", "null"], "description": "a JSON schema; enforced for forced calls"},
            "strict": {"type": ["boolean", "null"]},
        },
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
        "model": {"type": "string", "enum": [model_id]},
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


def response_schema(model_id: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "created_at": {"type": "integer"},
            "status": {"enum": ["completed", "incomplete"]},
            "model": {"const": model_id},
            "output": {
                "type": "array",
                "items": {"type": "object", "required": ["type"], "properties": {"type": {"enum": OUTPUT_TYPES}}},
            },
            "usage": {
                "type": "object",
                "required": ["input_tokens", "output_tokens", "total_tokens"],
                "properties": {
                    k: {"type": "integer", "minimum": 0} for k in ("input_tokens", "output_tokens", "total_tokens")
                },
            },
        },
    }


TOP = INT64[1]
OUTPUT_TYPES = ["reasoning", "message", "function_call"]
