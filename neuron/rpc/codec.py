"""Encode messages to lines and decode lines to messages, validating strictly.

Strict means: a line that is not one JSON object, names no known op, lacks a
field, carries a field we do not know, or carries one of the wrong type is
rejected with a ``ProtocolError`` of a named kind. A peer that drifts from the
protocol (a different version, a bug, garbage on the pipe) is caught at the
first line it sends, never half-understood.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import orjson

from neuron.rpc.messages import MAX_LINE_BYTES, REPLIES, REQUESTS, ErrorKind, Reply, Request


class ProtocolError(Exception):
    """A line that breaks the protocol. ``request_id`` is set when one could be read."""

    def __init__(self, kind: ErrorKind, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.request_id = request_id


@dataclasses.dataclass(frozen=True, slots=True)
class _Schema:
    cls: type
    fields: dict[str, Any]  # name -> resolved type hint


def _schemas(classes: tuple[type, ...]) -> dict[str, _Schema]:
    out = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        out[cls.op] = _Schema(cls, {f.name: hints[f.name] for f in dataclasses.fields(cls)})
    return out


_REQUEST_SCHEMAS = _schemas(REQUESTS)
_REPLY_SCHEMAS = _schemas(REPLIES)


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a decoded JSON value has the type ``hint`` names (the few types messages use)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_conforms(k, key) and _conforms(v, item) for k, v in value.items())
    if hint is type(None):
        return value is None
    # JSON has no int/bool distinction in Python's eyes (bool subclasses int): refuse true as 1.
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) is None and isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def encode(message: Request | Reply) -> bytes:
    """One message as one line, newline included."""
    body = {"op": message.op}
    for f in dataclasses.fields(message):
        body[f.name] = getattr(message, f.name)
    return orjson.dumps(body) + b"\n"


def _decode(line: bytes, schemas: dict[str, _Schema], what: str) -> Any:
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(
            ErrorKind.LINE_TOO_LONG, f"{what} line of {len(line)} bytes exceeds the cap of {MAX_LINE_BYTES}"
        )
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(ErrorKind.INVALID_JSON, f"{what} line is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorKind.INVALID_JSON, f"{what} line must be a JSON object, got {type(obj).__name__}")
    raw_id = obj.get("id")
    request_id = raw_id if _conforms(raw_id, int) else None
    op = obj.get("op")
    schema = schemas.get(op) if isinstance(op, str) else None
    if schema is None:
        known = ", ".join(sorted(schemas))
        raise ProtocolError(ErrorKind.UNKNOWN_OP, f"unknown {what} op {op!r}; expected one of: {known}", request_id)
    problems = []
    for name, hint in schema.fields.items():
        if name not in obj:
            problems.append(f"missing field {name!r}")
        elif not _conforms(obj[name], hint):
            problems.append(f"field {name!r} must be {_describe(hint)}, got {type(obj[name]).__name__}")
    problems += [f"unknown field {name!r}" for name in obj if name != "op" and name not in schema.fields]
    if problems:
        raise ProtocolError(ErrorKind.INVALID_FIELD, f"{op}: " + "; ".join(problems), request_id)
    return schema.cls(**{name: obj[name] for name in schema.fields})


def decode_request(line: bytes) -> Request:
    return _decode(line, _REQUEST_SCHEMAS, "request")


def decode_reply(line: bytes) -> Reply:
    return _decode(line, _REPLY_SCHEMAS, "reply")
