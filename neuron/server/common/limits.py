"""Bounds on what a request may hand to a recursive algorithm, checked before anything uses it. No MLX, no HTTP.

A JSON body can nest as deep as its parser allows (orjson reads 1,024 levels),
but much of what we do with it recurses: Python's ``json`` and Jinja's
``tojson`` on a chat template, orjson writing a reply (it writes fewer levels
than it reads, so an echoed field could fail after the whole generation), and
llguidance compiling a schema, whose recursion follows ``$ref`` as well as
brackets and faults the process when its stack runs out. So every such
structure is bounded here, by depth and by size, and refused with a 400 that
names the field and the limit.

A schema's bound is two numbers, the grammar's own (``grammar.MAX_DEPTH`` and
``grammar.MAX_REFS``: why those, there), checked here too so that the 400 names
the field that passed them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from neuron import grammar

MAX_BODY_DEPTH = 100  # levels of JSON anywhere in a body: a schema's 64 plus where it sits in the body
MAX_SCHEMA_DEPTH = grammar.MAX_DEPTH
MAX_SCHEMA_REFS = grammar.MAX_REFS  # distinct `$ref` values in one schema
MAX_SCHEMA_NODES = 250_000  # objects, arrays and values in one schema; a 4 MiB body holds up to 2 million
MAX_ARGUMENTS_DEPTH = MAX_SCHEMA_DEPTH  # levels of an earlier tool call's arguments
# OpenAI's own bounds on `metadata`.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
UNSUPPORTED_SCHEMA = "unsupported_schema"  # a code schemathesis's hook accepts for a schema-valid body
SCHEMA_FIELDS = frozenset({"response_format", "tools", "text"})  # top-level fields that carry JSON schemas


class LimitError(ValueError):
    """A bound passed: ``param`` names the field (None: the whole body), the message says which bound."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def bad(param: str | None, message: str, code: str = "invalid_value") -> LimitError:
    return LimitError(param, message, code)


def _containers(level: list[Any]) -> list[Any]:
    """The objects and arrays directly inside those of ``level``; one comprehension, so a wide level costs
    tens of nanoseconds per value: a 4 MiB body is checked on the event loop."""
    return [
        child
        for node in level
        for child in (node.values() if type(node) is dict else node)
        if type(child) is dict or type(child) is list
    ]


def _levels(value: Any) -> Iterator[list[Any]]:
    """The containers of ``value``, level by level from the top: level by level, not recursing, as the point is
    that the input may nest deeper than Python recurses."""
    level = [value] if type(value) is dict or type(value) is list else []
    while level:
        yield level
        level = _containers(level)


def too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` holds objects or arrays nested more than ``limit`` levels."""
    return any(depth > limit for depth, _ in enumerate(_levels(value), 1))


def check_body(body: Any) -> None:
    """A request body nests at most ``MAX_BODY_DEPTH`` levels; the 400 names the top-level field that does not."""
    if not too_deep(body, MAX_BODY_DEPTH):
        return
    deep = next((k for k, v in body.items() if too_deep(v, MAX_BODY_DEPTH - 1)), None) if type(body) is dict else None
    if deep is None:
        raise bad(None, f"the request body nests deeper than {MAX_BODY_DEPTH} levels", "too_deep")
    code = UNSUPPORTED_SCHEMA if deep in SCHEMA_FIELDS else "too_deep"
    raise bad(deep, f"`{deep}` nests deeper than {MAX_BODY_DEPTH} levels in the body", code)


def check_schema(schema: Any, where: str, param: str | None = None) -> None:
    """A JSON schema at ``where`` within the bounds above; a 400 (code ``unsupported_schema``, ``param`` or else
    ``where``) naming the bound passed. Only the bounds: whether llguidance can enforce the schema is the grammar's
    to tell."""
    param = param or where
    refs: set[str] = set()
    nodes = 1
    for depth, level in enumerate(_levels(schema), 1):
        if depth > MAX_SCHEMA_DEPTH:
            message = f"`{where}` nests deeper than {MAX_SCHEMA_DEPTH} levels; flatten the schema"
            raise bad(param, message, UNSUPPORTED_SCHEMA)
        nodes += sum(map(len, level))
        if nodes > MAX_SCHEMA_NODES:
            message = f"`{where}` holds more than {MAX_SCHEMA_NODES} values; send a smaller schema"
            raise bad(param, message, UNSUPPORTED_SCHEMA)
        refs.update(n["$ref"] for n in level if type(n) is dict and type(n.get("$ref")) is str)
        if len(refs) > MAX_SCHEMA_REFS:
            message = (
                f"`{where}` refers (`$ref`) to more than {MAX_SCHEMA_REFS} different places; "
                "inline some of its definitions or send a smaller schema"
            )
            raise bad(param, message, UNSUPPORTED_SCHEMA)


def tool_call_arguments(text: str, where: str) -> Any:
    """An earlier tool call's ``arguments`` (a JSON string) parsed for the chat template, within
    ``MAX_ARGUMENTS_DEPTH`` levels; the text as it came when it is not JSON."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        # Past orjson's own depth too: a string, handed on as a string, recurses nowhere.
        return text
    if too_deep(value, MAX_ARGUMENTS_DEPTH):
        raise bad(where, f"`{where}` nests deeper than {MAX_ARGUMENTS_DEPTH} levels")
    return value


def check_metadata(value: Any) -> None:
    """OpenAI's ``metadata``: at most 16 pairs of strings, keys of at most 64 characters, values of at most 512."""
    if value is None:
        return
    shape = (
        f"`metadata` must be an object of at most {MAX_METADATA_PAIRS} string values, keys of at most "
        f"{MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}"
    )
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise bad("metadata", shape)
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise bad(f"metadata.{key[:MAX_METADATA_KEY]}", shape)


METADATA_SCHEMA = {
    "type": ["object", "null"],
    "maxProperties": MAX_METADATA_PAIRS,
    "propertyNames": {"maxLength": MAX_METADATA_KEY},
    "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
    "description": "accepted and ignored; echoed by /v1/responses",
}
