"""OpenAI's Responses API (``POST /v1/responses``): a body read as a chat. No MLX, no HTTP.

Why a translation and not a route of its own all the way down: a Responses request is a chat (instructions,
messages, function calls and their outputs, tools) under other names. Turned into a chat body, it goes
through the chat's checks (``common.chat``), template and tool reading unchanged; only the names in errors
(here) and the reply objects (``render``) are this family's.

Stateless: no response is stored, so ``previous_response_id`` is refused; ``store`` is accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from neuron.server.common import limits
from neuron.server.common.content import responses_text
from neuron.server.common.errors import ApiError, bad, within_limits
from neuron.server.common.fields import IGNORED, an_object, type_of

ROLES = ("user", "system", "developer", "assistant")
PASSED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "priority")
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
    body = an_object(body)
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
        raise bad("instructions", f"`instructions` must be a string, got {type_of(instructions)}", "invalid_type")
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
            raise bad("reasoning", f"`reasoning` must be an object with an `effort`, got {type_of(reasoning)}")
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
            out.append({"role": _role(item, where), "content": responses_text(item.get("content"), f"{where}.content")})
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
        raise bad(f"{where}.{key}", f"`{where}.{key}` must be a string, got {type_of(value)}")
    return value


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
        raise bad("text", f"`text` must be an object with a `format`, got {type_of(text)}")
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("text.format", "`text.format.type` must be text, json_object or json_schema")
    if spec["type"] != "json_schema":
        return {"type": spec["type"]}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if k != "type"}}
