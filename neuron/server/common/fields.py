"""Typed reads of a request body's fields, shared by every family: each refusal names the field and the type it
must have. JSON has one number type; Python's bool is an int, so it is refused explicitly. No MLX, no HTTP.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from neuron.server.common.errors import ApiError, bad

INT64 = (-(2**63), 2**63 - 1)  # what JSON parsers on both ends agree an integer can be
TOKEN_ID = re.compile(r"[0-9]+")
# Accepted and ignored: they change nothing about what a single server generates.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


def type_of(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def get(body: dict[str, Any], name: str, expected: str, check: Callable[[Any], bool], default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad(name, f"`{name}` must be {expected}, got {type_of(value)}", "invalid_type")
    return value


def same(a: Any, b: Any) -> bool:
    """JSON equality that tells true from 1."""
    return type(a) is type(b) and a == b


def is_int64(value: Any) -> bool:
    # JSON Schema counts 2.0 as an integer, and so do we.
    whole = type(value) is int or (type(value) is float and value.is_integer())
    return whole and INT64[0] <= value <= INT64[1]


def integer(body: dict[str, Any], name: str, default: int | None = None) -> Any:
    value = get(body, name, "a 64-bit integer", is_int64, default)
    return value if value is None else int(value)


def number(body: dict[str, Any], name: str, default: float) -> float:
    return float(get(body, name, "a number", lambda v: type(v) in (int, float), default))


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    return get(body, name, "a boolean", lambda v: type(v) is bool, default)


def an_object(body: Any) -> dict[str, Any]:
    """The body, which must be a JSON object."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type_of(body)}", code="invalid_body")
    return body


def known(body: dict[str, Any], fields: frozenset[str]) -> None:
    """Every field of ``body`` among ``fields``; the first that is not, refused by name."""
    for name in body:
        if name not in fields:
            raise bad(name, f"unrecognized request argument `{name}`", "unknown_parameter")


class Served(str):
    """The base model's id, as routes pass it on, with the LoRA adapters served beside it: a request's ``model``
    may name either (``served``)."""

    adapters: tuple[str, ...] = ()

    def __new__(cls, base: str, adapters: tuple[str, ...] = ()) -> Served:
        served = super().__new__(cls, base)
        served.adapters = adapters
        return served


def served(model: Any, served_model: str) -> None:
    """``model`` (when given) is the one served, or one of its LoRA adapters; 404 otherwise, as OpenAI answers an
    unknown model."""
    adapters = served_model.adapters if isinstance(served_model, Served) else ()
    if model is not None and model != served_model and model not in adapters:
        also = f" and its adapters {', '.join(adapters)}" if adapters else ""
        message = f"the model `{model}` does not exist; this server serves `{served_model}`{also}"
        raise ApiError(404, message, param="model", code="model_not_found")


def model(body: dict[str, Any], served_model: str) -> str:
    """The required ``model``, which must be the one served."""
    value = get(body, "model", "a string", lambda v: isinstance(v, str), None)
    if value is None:
        raise bad("model", "`model` is required; GET /v1/models lists the one served", "missing_required_parameter")
    served(value, served_model)
    return value


def prompts(value: Any, name: str = "prompt") -> list[str | list[int]]:
    """One prompt (text or token ids) or a list of them; OpenAI's four shapes (the embeddings' ``input`` too)."""
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        return [_prompt(p, f"{name}[{i}]") for i, p in enumerate(value)]
    return [_prompt(value, name)]


def _prompt(value: Any, where: str) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise bad(where, f"`{where}` is empty")
        return value
    if isinstance(value, list) and value and all(is_int64(t) for t in value):
        return [int(t) for t in value]
    raise bad(where, f"`{where}` must be a string or an array of token ids, got {type_of(value)}")
