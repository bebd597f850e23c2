"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): a body read as a chat. No MLX,
no HTTP.

As with the Responses API, a translation rather than a route of its own all the way down: ``system``,
``messages`` with ``tool_use`` and ``tool_result`` blocks, ``tools`` and ``tool_choice`` are a chat under other
names, so the chat's checks (``common.chat``), template, tool reading and reasoning split serve it unchanged.
``thinking`` turns the template's thinking section on or off (``enable_thinking``); ``budget_tokens`` is
accepted and not enforced (the thinking ends when the model ends it, within ``max_tokens``).

A stop sequence ends the text as ``stop``, which does not say which string it was: the chat is asked to keep
the stop string in the text (vLLM's ``include_stop_str_in_output``), and ``render`` cuts it off, where
``stop_reason`` becomes ``stop_sequence`` and ``stop_sequence`` names it.
"""

from __future__ import annotations

import json
from typing import Any

from neuron.server.common.content import anthropic_block, anthropic_part, anthropic_text, anthropic_user
from neuron.server.common.errors import ApiError, bad
from neuron.server.common.fields import an_object, is_int64, type_of

PASSED = ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", "priority")
ACCEPTED = frozenset(
    {*PASSED, "system", "messages", "stop_sequences", "tools", "tool_choice", "thinking", "output_config"}
)
# Accepted and ignored: billing, routing and caching hints that change nothing a single server generates.
# Claude Code sends `context_management` (its edits clear old tool results past a threshold); neuron keeps the
# conversation as sent, which fits any context the request fits.
IGNORED_HERE = frozenset({"metadata", "service_tier", "cache_control", "inference_geo", "speed", "context_management"})
COUNT_FIELDS = frozenset(
    {"model", "system", "messages", "tools", "tool_choice", "thinking", "cache_control", "output_config"}
)
TOOL_IGNORED = frozenset(
    {"cache_control", "defer_loading", "eager_input_streaming", "input_examples", "strict", "allowed_callers"}
)
# Chat names in errors raised by the chat route's checks, as this route calls them.
RENAMED = {
    "stop": "stop_sequences",
    "max_completion_tokens": "max_tokens",
    "chat_template_kwargs": "thinking",
    "response_format": "output_config.format",
}
ROLES = ("user", "assistant", "system")


def to_chat(body: Any, *, counting: bool = False) -> dict[str, Any]:
    """A Messages body as the chat body that asks for the same; ``ApiError`` naming this route's fields.
    ``counting``: a count_tokens body, which has no ``max_tokens`` and generates nothing."""
    body = an_object(body)
    allowed = COUNT_FIELDS if counting else ACCEPTED | IGNORED_HERE
    for name in body:
        if name not in allowed:
            raise bad(name, f"unrecognized request argument `{name}`", "unknown_parameter")
    chat: dict[str, Any] = {name: body[name] for name in PASSED if name in body}
    if counting:
        chat["max_tokens"] = 1
    elif body.get("max_tokens") is None:
        raise bad("max_tokens", "`max_tokens` is required", "missing_required_parameter")
    chat["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    if (stops := body.get("stop_sequences")) is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop_sequences", "`stop_sequences` must be an array of strings", "invalid_type")
        if stops:
            chat["stop"], chat["include_stop_str_in_output"] = stops, True
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if (choice := body.get("tool_choice")) is not None:
        choice = _tool_choice(choice)
        # auto with no tools is a reply without calls, as Anthropic answers it.
        if choice["tool_choice"] != "auto" or chat.get("tools"):
            chat.update(choice)
    if (thinking := body.get("thinking")) is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": _thinking(thinking)}
    if (config := body.get("output_config")) is not None:
        chat.update(_output_config(config))
    return chat


def _output_config(value: Any) -> dict[str, Any]:
    """``format`` (a JSON schema the text must match) as the chat's ``response_format``; ``effort`` is accepted and
    not applied: Anthropic's levels have no counterpart in a chat template's."""
    if not isinstance(value, dict) or not set(value) <= {"format", "effort"}:
        raise bad("output_config", "`output_config` is an object with `format` and `effort`")
    effort = value.get("effort")
    if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
        raise bad("output_config.effort", "`output_config.effort` must be low, medium, high, xhigh or max")
    spec = value.get("format")
    if spec is None:
        return {}
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise bad("output_config.format", '`output_config.format` must be {"type": "json_schema", "schema": {...}}')
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"]}}}


def renamed(error: ApiError) -> ApiError:
    """An error of the chat route's checks, with this route's field names."""
    head = (error.param or "").split("[", 1)[0].split(".", 1)[0]
    if head not in RENAMED:
        return error
    message = error.message.replace(f"`{head}", f"`{RENAMED[head]}")
    param = RENAMED[head] + (error.param or "")[len(head) :]
    return ApiError(error.status, message, type=error.type, param=param, code=error.code, headers=error.headers)


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, list):
        value = anthropic_text(value, "system")
    if not isinstance(value, str):
        raise bad("system", f"`system` must be a string or an array of text blocks, got {type_of(value)}")
    return [{"role": "system", "content": value}] if value else []


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "`messages` must be a non-empty array of messages", "missing_required_parameter")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(f"{where}.role", f"`{where}` must be an object with `role` user or assistant and `content`")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list) and message["role"] == "system":
            # Claude Code puts system turns mid-conversation; the template places them.
            out.append({"role": "system", "content": anthropic_text(content, f"{where}.content")})
        elif isinstance(content, list):
            out += _user(content, where) if message["role"] == "user" else [_assistant(content, where)]
        else:
            raise bad(f"{where}.content", f"`{where}.content` must be a string or an array of content blocks")
    return out


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn: each ``tool_result`` a tool message (they answer the previous turn's calls), then the text."""
    results: list[dict[str, Any]] = []
    texts: list[str | dict[str, Any]] = []
    for i, block in enumerate(blocks):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise bad(f"{at}.tool_use_id", f"`{at}.tool_use_id` must be a string")
            output = block.get("content", "")
            if isinstance(output, list):
                output = anthropic_text(output, f"{at}.content")
            elif not isinstance(output, str):
                raise bad(f"{at}.content", f"`{at}.content` must be a string or an array of text blocks")
            if block.get("is_error") is not None and type(block["is_error"]) is not bool:
                raise bad(f"{at}.is_error", f"`{at}.is_error` must be a boolean")
            if block.get("is_error"):
                output = f"Error: {output}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            texts.append(anthropic_part(block, at))
    return results + ([{"role": "user", "content": anthropic_user(texts)}] if texts or not results else [])


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    """An assistant turn: its text and ``tool_use`` calls; earlier thinking is left out, as templates do."""
    texts, calls = [], []
    for i, block in enumerate(blocks):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad(at, f"`{at}` must be a tool_use block with `id`, `name` and `input`")
            if not isinstance(block.get("input"), dict):
                raise bad(f"{at}.input", f"`{at}.input` must be an object")
            arguments = json.dumps(block["input"])
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            texts.append(anthropic_block(block, at))
    return {"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})}


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad("tools", "`tools` must be an array of {name, description, input_schema}")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, dict) else type_of(tool)
            raise bad(where, f"`{where}` is a {kind!r} tool; neuron runs no server tools: send custom tools")
        for key in tool:
            if key not in ("type", "name", "description", "input_schema") and key not in TOOL_IGNORED:
                raise bad(f"{where}.{key}", f"unrecognized tool argument `{where}.{key}`", "unknown_parameter")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad(f"{where}.input_schema", f"`{where}.input_schema` must be a JSON schema object")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad(
            "tool_choice",
            '`tool_choice` must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name"} or {"type": "none"}',
        )
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and type(parallel) is not bool:
        raise bad("tool_choice.disable_parallel_tool_use", "`tool_choice.disable_parallel_tool_use` must be a boolean")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad("tool_choice.name", "`tool_choice.name` must name one of `tools`")
        out: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    else:
        out = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[kind]}
    if parallel is not None:
        out["parallel_tool_calls"] = not parallel
    return out


def _thinking(value: Any) -> bool:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad(
            "thinking",
            '`thinking` must be {"type": "enabled", "budget_tokens"}, {"type": "adaptive"} or {"type": "disabled"}',
        )
    budget = value.get("budget_tokens")
    if budget is not None and not (is_int64(budget) and budget >= 1):
        raise bad("thinking.budget_tokens", "`thinking.budget_tokens` must be a positive integer")
    return kind != "disabled"
