"""Encode messages to lines and decode lines to messages, validating strictly.

Strict means: a line that is not one JSON object, names no known op, lacks a
field, carries a field we do not know, or carries one of the wrong type is
rejected with a ``ProtocolError`` of a named kind. A peer that drifts from the
protocol (a different version, a bug, garbage on the pipe) is caught at the
first line it sends, never half-understood.
"""

from __future__ import annotations

import dataclasses
import functools
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


def _fields(cls: Any) -> dict[str, Any]:
    return _resolved_fields(cls)


@functools.cache  # resolving the hints was most of a message's decoding, and a step's plan nests dataclasses
def _resolved_fields(cls: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _schemas(classes: tuple[type[Any], ...]) -> dict[str, _Schema]:
    return {cls.op: _Schema(cls, _fields(cls)) for cls in classes}


_REQUEST_SCHEMAS = _schemas(REQUESTS)
_REPLY_SCHEMAS = _schemas(REPLIES)


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a decoded JSON value has the type ``hint`` names (the few types messages use)."""
    return not _problems(value, hint, "")


def _problems(value: Any, hint: Any, where: str) -> list[str]:
    """What keeps ``value`` from being a ``hint``, each problem named by its path (``plan.prefill[0].tokens``)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if any(_conforms(value, arg) for arg in typing.get_args(hint)):
            return []
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(hint)
            # The first bad item only: a prompt of a million bad tokens needs one message, not a million.
            return next(filter(None, (_problems(v, item, f"{where}[{i}]") for i, v in enumerate(value))), [])
    elif origin is dict:
        key, item = typing.get_args(hint)
        if isinstance(value, dict) and all(_conforms(k, key) and _conforms(v, item) for k, v in value.items()):
            return []
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return _field_problems(value, _fields(hint), f"{where}.")
    elif hint is type(None):
        if value is None:
            return []
    # JSON has no int/bool distinction in Python's eyes (bool subclasses int): refuse true as 1.
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return []
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return []
    elif isinstance(value, hint):
        return []
    return [f"field {where!r} must be {_describe(hint)}, got {type(value).__name__}"]


def _field_problems(obj: dict[str, Any], fields: dict[str, Any], prefix: str) -> list[str]:
    problems = []
    for name, hint in fields.items():
        if name not in obj:
            problems.append(f"missing field {prefix + name!r}")
        else:
            problems += _problems(obj[name], hint, prefix + name)
    skip = {"op"} if not prefix else set()
    return problems + [f"unknown field {prefix + n!r}" for n in obj if n not in fields and n not in skip]


def _build(value: Any, hint: Any) -> Any:
    """A checked JSON value as ``hint``: nested dataclasses are rebuilt from their objects."""
    if dataclasses.is_dataclass(hint):
        return hint(**{name: _build(value[name], h) for name, h in _fields(hint).items()})  # type: ignore[operator]
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return [_build(v, item) for v in value] if dataclasses.is_dataclass(item) else value
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and value is not None:
        # An optional field (``Memory | None``), checked already: a value that is not None is its one other member.
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return _build(value, members[0]) if len(members) == 1 else value
    return value


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) is None and isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("neuron.rpc.messages.", "").replace("neuron.rpc.plan.", "")


def encode(message: Request | Reply) -> bytes:
    """One message as one line, newline included."""
    # orjson writes nested dataclasses (a step's plan) as objects of their fields.
    body = {"op": message.op, **{f.name: getattr(message, f.name) for f in dataclasses.fields(message)}}
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
    if problems := _field_problems(obj, schema.fields, ""):
        raise ProtocolError(ErrorKind.INVALID_FIELD, f"{op}: " + "; ".join(problems), request_id)
    return _build(obj, schema.cls)


def decode_request(line: bytes) -> Request:
    return _decode(line, _REQUEST_SCHEMAS, "request")


def decode_reply(line: bytes) -> Reply:
    return _decode(line, _REPLY_SCHEMAS, "reply")
