"""A chat request, checked: what chat completions' body asks for, and what the Responses and Messages families'
bodies are translated into (their ``parse.to_chat``), so one set of checks, one template and one tool reader
serve all three. Messages and their earlier tool calls, tools, reasoning controls, and the rules that tie them
to ``response_format`` and ``n``. A message's content parts are read in ``content``. No MLX, no HTTP.
"""

from __future__ import annotations

from typing import Any

from neuron.sampling_params import MAX_TOP_LOGPROBS
from neuron.server.common import limits, reasoning, tools
from neuron.server.common.content import CHAT_PART, chat_text, check_images
from neuron.server.common.errors import bad, within_limits
from neuron.server.common.fields import flag, integer, type_of
from neuron.server.common.generation import CHAT_MAX_TOKENS, SAMPLING_FIELDS, UNSUPPORTED, Generation, begin, finish
from neuron.server.common.schema import Schema, or_null

FIELDS = SAMPLING_FIELDS | {
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",  # read by common/tools.py
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",  # read by common/reasoning.py
    "include_reasoning",
    "reasoning_effort",
}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def parse(body: Any, served_model: str) -> Generation:
    """Check a chat body; raise ``ApiError`` naming the first bad field."""
    gen = begin(body, chat=True, served_model=served_model, allowed=FIELDS, unsupported=UNSUPPORTED)
    gen.messages = messages(body.get("messages"))
    # Both are checked; the newer name wins.
    legacy = integer(body, "max_tokens", None)
    max_tokens = integer(body, "max_completion_tokens", legacy)
    gen.logprobs = flag(body, "logprobs")
    top = integer(body, "top_logprobs", None)
    if top is not None and not gen.logprobs:
        raise bad("top_logprobs", "`top_logprobs` needs `logprobs` set to true")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad("top_logprobs", f"`top_logprobs` must lie in [0, {MAX_TOP_LOGPROBS}], got {top}")
    finish(gen, body, CHAT_MAX_TOKENS, (top or 0) if gen.logprobs else None, max_tokens)
    gen.tools = tools.parse(body)
    for i, spec in enumerate(body.get("tools") or []):
        # Bounded whatever the choice: auto hands them to the chat template, the forced kinds to the grammar.
        where = f"tools[{i}].function.parameters"
        within_limits(limits.check_schema, spec["function"].get("parameters") or {}, where)
    gen.reasoning = reasoning.parse(body)
    if gen.tools is not None and gen.schema is not None and not gen.tools.auto:
        raise bad("response_format", "`response_format` and a forced `tool_choice` both shape the output")
    if gen.n > 1 and (gen.schema is not None or (gen.tools is not None and not gen.tools.auto)):
        # A constraint follows one sequence's tokens; n copies would need n compiled grammars.
        raise bad("n", "`n` above 1 cannot be combined with `response_format` or a forced `tool_choice`")
    return gen


def messages(value: Any) -> list[dict[str, Any]]:
    """A chat's ``messages``, checked, as the chat template gets them."""
    if not isinstance(value, list):
        raise bad(
            "messages", f"`messages` must be an array of messages, got {type_of(value)}", "missing_required_parameter"
        )
    if not value:
        raise bad("messages", "`messages` is empty: send at least one message")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"`{where}` must be an object with `role` and `content`, got {type_of(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(f"{where}.role", f"`{where}.role` must be one of {', '.join(ROLES)}, got {role!r}")
        entry: dict[str, Any] = {"role": ROLES[role], "content": chat_text(message.get("content"), f"{where}.content")}
        if message.get("tool_calls") is not None:
            calls = _calls(message["tool_calls"], f"{where}.tool_calls")
            if role == "assistant" and calls:
                entry["tool_calls"] = calls
        if (call_id := message.get("tool_call_id")) is not None:
            if not isinstance(call_id, str):
                raise bad(f"{where}.tool_call_id", f"`{where}.tool_call_id` must be a string")
            entry["tool_call_id"] = call_id
        out.append(entry)
    check_images(out)
    return out


def _calls(value: Any, where: str) -> list[dict[str, Any]]:
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


# The OpenAPI pieces of a chat's messages, beside the checks they describe (chat completions' and /tokenize's).

MESSAGE: Schema = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": or_null({"anyOf": [{"type": "string"}, {"type": "array", "items": CHAT_PART}]}),
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
                            "properties": {
                                "name": {"type": "string"},
                                "arguments": or_null({"type": "string", "description": "JSON"}),
                            },
                        }
                    },
                },
            }
        ),
        "tool_call_id": or_null({"type": "string"}),
    },
}


def messages_schema(context: int | None) -> Schema:
    note = f"at most {context - 1} tokens" if context else "shorter than the model's context"
    return {
        "type": "array",
        "minItems": 1,
        "items": MESSAGE,
        "description": f"the chat, through the model's template: {note}",
    }
