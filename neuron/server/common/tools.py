"""Tool calling: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked, the tools shown to the model, and
its calls read back out of its text into OpenAI's ``tool_calls``, whole or streamed. No MLX.

The tools reach the model one of two ways. A model whose chat template renders ``tools``, in a call format
mlx-lm can read (``Text.tool_markup``), gets them, and the history's calls and results, through its template.
Any other model gets them as text (``template_messages``): the functions in a system message, earlier calls as
the JSON of a call, results as user messages; so every template renders them, whatever roles it knows.

A call comes out of the model one of three ways:

- ``auto`` on a model whose template shows it the tools: the model writes calls in its family's markup
  (``<tool_call>{...}</tool_call>`` for Hermes and Qwen, ``[TOOL_CALLS]`` for Mistral, ...), read with
  mlx-lm's parser for the family. The text outside the markup is the content; markup never reaches it.
- ``auto`` on any other model: a reply that opens with the JSON of calls (``[{"name", "parameters"}, ...]``,
  what the system message asks for and the history shows) is read as calls, what follows it as content.
- ``required`` or a named function: the output is constrained to the JSON of the call, as vLLM does it, with
  a schema built here from the tools' parameters (``Tools.schema``): ``[{"name", "parameters"}, ...]``, or the
  named function's arguments alone. So even a model that never learnt tools returns a valid call.

A call that does not parse leaves the whole text as a plain-text answer.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from neuron.server.common.errors import bad

log = structlog.get_logger("neuron.server")

ToolMarkup = tuple[str, str, Callable[[str, Any], Any]]  # start marker, end marker ("" for none), parser
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
NO_PARAMETERS = {"type": "object", "properties": {}}
CUT_CALL = re.compile(r'"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"parameters"\s*:\s*')  # Tools.schema's order


@dataclass(frozen=True, slots=True)
class Tools:
    specs: list[dict[str, Any]]  # as the client sent them: what the chat template reads
    parameters: dict[str, dict[str, Any]]  # function name -> its parameters' JSON schema
    choice: str  # "auto", "required", or the name of the function to call
    parallel: bool

    @property
    def auto(self) -> bool:
        return self.choice == "auto"

    def schema(self) -> dict[str, Any] | None:
        """What a forced call's output must match; None for ``auto``, where the model chooses."""
        if self.auto:
            return None
        if self.choice != "required":
            return self.parameters[self.choice]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": _resource(name, parameters)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, parameters in self.parameters.items()
        ]
        return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}


def _resource(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters as a schema resource of their own, placed in the wrapper around the tools: their
    ``$ref``s (``#/$defs/...``, as pydantic writes them; ``#`` for their root) then resolve within them, not
    against the wrapper. The ``$id`` is neuron's even where the tool gave one, which two tools could share."""
    return {**parameters, "$id": f"urn:neuron:tool:{name}"}


def parse(body: dict[str, Any]) -> Tools | None:
    """The request's tools, or None when it asks for no tool call (none given, or ``tool_choice`` "none")."""
    specs = body.get("tools")
    if specs is not None and not isinstance(specs, list):
        raise bad("tools", "`tools` must be an array of {type: function, function: {name, parameters}}")
    specs = specs or []
    parameters: dict[str, dict[str, Any]] = {}
    for i, spec in enumerate(specs):
        where = f"tools[{i}]"
        function = spec.get("function") if isinstance(spec, dict) else None
        if not isinstance(spec, dict) or spec.get("type") != "function" or not isinstance(function, dict):
            raise bad(where, f"`{where}` must be {{type: function, function: {{name, parameters}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad(f"{where}.function.name", f"`{where}.function.name` must match {NAME.pattern}, got {name!r}")
        schema = function.get("parameters")
        if schema is not None and not isinstance(schema, dict):
            raise bad(f"{where}.function.parameters", f"`{where}.function.parameters` must be a JSON schema object")
        for key, kind in (("description", str), ("strict", bool)):
            if function.get(key) is not None and type(function[key]) is not kind:
                raise bad(f"{where}.function.{key}", f"`{where}.function.{key}` must be a {kind.__name__}")
        parameters[name] = schema or NO_PARAMETERS
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if specs else "none"
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or name not in parameters:
            names = ", ".join(parameters) or "none given"
            raise bad("tool_choice", f"`tool_choice` must name one of the tools given: {names}", "tool_not_found")
        choice = name
    elif choice not in ("none", "auto", "required"):
        expected = '"none", "auto", "required" or {type: function, function: {name}}'
        raise bad("tool_choice", f"`tool_choice` must be {expected}")
    elif choice == "auto" and not specs:
        choice = "none"  # the model may call any of no tools: as OpenAI takes it, nothing to refuse
    elif choice == "required" and not specs:
        message = "`tool_choice` 'required' must name one of the tools given, and none is: send `tools`"
        raise bad("tool_choice", message, "tool_not_found")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise bad("parallel_tool_calls", "`parallel_tool_calls` must be a boolean")
    if choice == "none":
        return None
    return Tools(specs, parameters, choice, parallel is not False)


def template_messages(
    messages: list[dict[str, Any]], tools: Tools | None, markup: ToolMarkup | None
) -> list[dict[str, Any]]:
    """The messages as the chat template gets them. With the model's own call ``markup`` (its template renders
    tools), as they came. Otherwise as text any template renders: the functions and how to call them in a
    system message, earlier calls as the JSON of a call, and their results as user messages (a template that
    knows only users and assistants would refuse the role ``tool``, or show it to a model that never saw it)."""
    if markup is not None:
        return messages
    names = {call.get("id"): call["function"]["name"] for m in messages for call in m.get("tool_calls") or []}
    out: list[dict[str, Any]] = []
    results = False  # whether the last message out holds tool results, which the next one joins
    for message in messages:
        if message["role"] == "tool":
            name = names.get(message.get("tool_call_id"))
            said = f"{name} returned: " if name else "A function returned: "
            if results:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + said + message["content"]}
            else:
                out.append({"role": "user", "content": said + message["content"]})
            results = True
            continue
        results = False
        if calls := message.get("tool_calls"):
            written = json.dumps([{"name": f["name"], "parameters": f["arguments"]} for f in _functions(calls)])
            message = {"role": message["role"], "content": (message["content"] + "\n" + written).lstrip()}
        out.append({k: v for k, v in message.items() if k in ("role", "content")})
    if tools is not None:
        listing = f"You can call these functions. {_how(tools)}\n{json.dumps(tools.specs)}"
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _functions(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [call["function"] for call in calls]


def _how(tools: Tools) -> str:
    calls = 'a JSON array of calls, [{"name": ..., "parameters": {...}}]'
    if tools.auto:
        return f"To call any, answer with only {calls}; otherwise answer in text."
    if tools.choice == "required":
        return f"Answer with {calls}."
    return f"Call {tools.choice}: answer with its arguments as a JSON object."


def _call(name: Any, arguments: Any, known: dict[str, Any]) -> dict[str, Any]:
    if name not in known:
        raise ValueError(f"a call to {name!r}, which is not among the tools")
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("tool-call arguments must be a JSON object")
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


class ToolStream(Protocol):
    """What the reply routes read a reply's tool calls through, as it comes, whichever way the model writes them:
    ``TextToolStream`` out of the text, ``harmony.Calls`` from what harmony's parser took out of it."""

    streams: bool  # whether ``deltas`` gives the calls as they come
    tools: Tools
    error: str | None  # why the calls did not parse, when they did not

    def push(self, text: str) -> str:
        """Add text; return the content that may be released now."""

    def deltas(self) -> list[dict[str, Any]]:
        """The calls' pieces written since last asked, as chat stream deltas (``tool_calls[]`` with ``index``)."""

    def finish(self, reason: str) -> tuple[str, list[dict[str, Any]], str]:
        """The content still to release, the tool calls, and the finish reason."""


class TextToolStream:
    """A ``ToolStream`` that reads the calls out of the reply's text: releases the content at once, holds what may
    be a tool call to the end.

    ``markup``: the model's own call format, where its template shows it the tools; None where neuron shows them.
    """

    streams = False

    def __init__(self, tools: Tools, markup: ToolMarkup | None) -> None:
        self.tools = tools
        self.markup = markup
        self._pending = ""  # the end of the text, which may be the start of a marker
        self._held: str | None = None  # from the first marker on (all of it for a forced call); None before
        self._plain = False  # neuron's form: the reply opened with text, so it holds no call
        self.error: str | None = None  # why the calls did not parse, when they did not

    def push(self, text: str) -> str:
        if not self.tools.auto or self._held is not None:
            self._held = (self._held or "") + text
            return ""
        if self.markup is None:
            return self._open(text)
        start = self.markup[0]
        pending = self._pending + text
        if start and (at := pending.find(start)) >= 0:
            self._pending, self._held = "", pending[at:]
            return pending[:at]
        keep = next((k for k in range(min(len(start) - 1, len(pending)), 0, -1) if pending.endswith(start[:k])), 0)
        self._pending = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def _open(self, text: str) -> str:
        """neuron's form: calls open the reply, so its first visible character tells a call from text."""
        if self._plain:
            return text
        pending = self._pending + text
        head = pending.lstrip()
        if head[:1] in ("[", "{"):
            self._pending, self._held = "", pending
            return ""
        self._plain = bool(head)
        self._pending = "" if head else pending
        return pending if head else ""

    def deltas(self) -> list[dict[str, Any]]:
        return []  # a call is read whole at the end

    def finish(self, reason: str) -> tuple[str, list[dict[str, Any]], str]:
        held, self._held = self._held or "", None
        if held and reason == "length" and not self.tools.auto and (cut := self._cut(held)):
            # A forced call cut short by max_tokens is still the call, its arguments unfinished.
            return self._pending, [cut], reason
        if not held or reason != "stop":
            # Cut short by max_tokens (or none): no call to parse; the text is the answer.
            return self._pending + held, [], reason
        try:
            if not self.tools.auto:
                content, calls = self._forced(held)
            else:
                content, calls = self._marked(held) if self.markup else self._opening(held)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:  # JSON nested past Python's
            self.error = str(e)
            return self._pending + held, [], reason
        # OpenAI's own reasons: a call the model chose (auto, required) ends with "tool_calls", a function the
        # request named ends with "stop", streamed or not (vLLM matches it; clients check it).
        return content, calls, "tool_calls" if calls and self.tools.choice in ("auto", "required") else reason

    def _cut(self, text: str) -> dict[str, Any] | None:
        """A forced call cut short: the named function's arguments as far as they came, or (``required``) the
        first call's name and parameters as far as they came; None where not even the name came."""
        name, arguments = self.tools.choice, text
        if name == "required":
            found = CUT_CALL.search(text)
            if found is None:
                return None
            name, arguments = found.group(1), text[found.end() :]
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    def _forced(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        value = json.loads(text)
        if self.tools.choice != "required":
            return "", [_call(self.tools.choice, value, self.tools.parameters)]
        return "", [_call(c["name"], c["parameters"], self.tools.parameters) for c in value]

    def _opening(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The calls that open a reply in neuron's form, and the text after them; "arguments", which models
        trained on Hermes' markup write, is read as well as "parameters"."""
        text = text.lstrip()
        value, at = json.JSONDecoder().raw_decode(text)
        written = value if isinstance(value, list) else [value]
        if not written:
            raise ValueError("an empty array of calls")
        calls = [_call(c["name"], c.get("parameters", c.get("arguments", {})), self.tools.parameters) for c in written]
        return text[at:].strip(), calls

    def _marked(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        assert self.markup is not None
        start, end, parser = self.markup
        content, calls = [], []
        for block in text.split(start)[1:]:
            body, _, after = block.partition(end) if end else (block, "", "")
            parsed = parser(body, self.tools.specs)
            for call in parsed if isinstance(parsed, list) else [parsed]:
                calls.append(_call(call.get("name"), call.get("arguments", {}), self.tools.parameters))
            content.append(after)
        return "".join(content).strip(), calls


def end(reader: ToolStream | None, text: str, reason: str) -> tuple[str, list[dict[str, Any]] | None, str]:
    """The last text, the tool calls and the finish reason, once the model is done."""
    if reader is None:
        return text, None, reason
    released = reader.push(text)
    tail, calls, reason = reader.finish(reason)
    if reader.error:
        log.warning("tool calls did not parse; answering with the text", error=reader.error)
    if not reader.tools.parallel:
        calls = calls[:1]  # parallel_tool_calls false: the first call only, whatever more the model wrote
    return released + tail, calls or None, reason


# The OpenAPI pieces of this route family, beside the checks they describe.

CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON"}},
        },
    },
}


# A function tool as chat completions nest it (`tools[i].function`); the Responses API's tools are this, typed.
FUNCTION: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": f"^{NAME.pattern}$"},
        "description": {"type": ["string", "null"]},
        "parameters": {"type": ["object", "null"], "description": "a JSON schema; enforced for forced calls"},
        "strict": {"type": ["boolean", "null"]},
    },
}


def request_properties() -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``."""
    function = FUNCTION
    named = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
        },
        "description": "one of `tools` by name (a name not among them is a 400, code tool_not_found)",
    }
    return {
        "tools": {
            "anyOf": [
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "function"],
                        "properties": {"type": {"const": "function"}, "function": function},
                    },
                },
                {"type": "null"},
            ]
        },
        "tool_choice": {
            "anyOf": [{"enum": ["none", "auto", "required"]}, named, {"type": "null"}],
            "description": "default: auto with tools, none without",
        },
        "parallel_tool_calls": {"type": ["boolean", "null"]},
    }


def request_rules(shaping: str = "response_format", shaped: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """What ties the tool fields together: a forced call needs tools, and a forced call and a structured output
    (``shaping`` when it matches ``shaped``) do not go together."""
    forced = {"anyOf": [{"const": "required"}, {"type": "object"}]}
    structured = {
        "type": "object",
        "properties": {"type": {"enum": ["json_object", "json_schema"]}},
        "required": ["type"],
    }
    return [
        {
            "if": {"properties": {"tool_choice": forced}, "required": ["tool_choice"]},
            "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
        },
        {
            # Both would shape the output: one constraint per request.
            "not": {
                "required": [shaping, "tool_choice"],
                "properties": {shaping: shaped or structured, "tool_choice": forced},
            }
        },
    ]
