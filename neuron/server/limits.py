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


def _children(node: Any) -> Any:
    return node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()


def too_deep(value: Any, limit: int) -> tuple[str, ...] | None:
    """The path to the first container nested deeper than ``limit`` levels in ``value``, or None.

    Walked with a stack, not recursion: the point is that the input may nest deeper than Python recurses.
    """
    stack: list[tuple[Any, int, tuple[str, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if depth > limit:
            return path
        items = node.items() if isinstance(node, dict) else ((f"[{i}]", v) for i, v in enumerate(node))
        stack.extend((child, depth + 1, (*path, str(key))) for key, child in items)
    return None


def _field(path: tuple[str, ...]) -> str:
    return "".join(part if part.startswith("[") else f".{part}" for part in path).lstrip(".")


def check_body(body: Any) -> None:
    """A request body nests at most ``MAX_BODY_DEPTH`` levels; the 400 names the top-level field that does not."""
    path = too_deep(body, MAX_BODY_DEPTH)
    if path is None:
        return
    if not path or not isinstance(body, dict):
        raise bad(None, f"the request body nests deeper than {MAX_BODY_DEPTH} levels", "too_deep")
    code = UNSUPPORTED_SCHEMA if path[0] in SCHEMA_FIELDS else "too_deep"
    raise bad(path[0], f"`{path[0]}` nests deeper than {MAX_BODY_DEPTH} levels (at `{_field(path)}`)", code)


def check_schema(schema: Any, where: str, param: str | None = None) -> None:
    """A JSON schema at ``where`` within the bounds above; a 400 (code ``unsupported_schema``, ``param`` or else
    ``where``) naming the bound passed. Only the bounds: whether llguidance can enforce the schema is the grammar's
    to tell."""
    param = param or where
    refs: set[str] = set()
    nodes = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            message = f"`{where}` holds more than {MAX_SCHEMA_NODES} values; send a smaller schema"
            raise bad(param, message, UNSUPPORTED_SCHEMA)
        if not isinstance(node, dict | list):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise bad(
                param, f"`{where}` nests deeper than {MAX_SCHEMA_DEPTH} levels; flatten the schema", UNSUPPORTED_SCHEMA
            )
        if isinstance(node, dict) and isinstance(ref := node.get("$ref"), str):
            refs.add(ref)
            if len(refs) > MAX_SCHEMA_REFS:
                message = (
                    f"`{where}` refers (`$ref`) to more than {MAX_SCHEMA_REFS} different places; "
                    "inline some of its definitions or send a smaller schema"
                )
                raise bad(param, message, UNSUPPORTED_SCHEMA)
        stack.extend((child, depth + 1) for child in _children(node))


def tool_call_arguments(text: str, where: str) -> Any:
    """An earlier tool call's ``arguments`` (a JSON string) parsed for the chat template, within
    ``MAX_ARGUMENTS_DEPTH`` levels; the text as it came when it is not JSON."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        # Past orjson's own depth too: a string, handed on as a string, recurses nowhere.
        return text
    if too_deep(value, MAX_ARGUMENTS_DEPTH) is not None:
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
