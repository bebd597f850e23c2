"""Hostile request pieces the bound tests share: JSON nested past a limit, and `$ref` chains."""

from __future__ import annotations

from typing import Any


def nested(levels: int, leaf: Any = 1) -> Any:
    """``leaf`` inside ``levels`` objects, one in the other."""
    for _ in range(levels):
        leaf = {"a": leaf}
    return leaf


def ref_chain(links: int) -> dict[str, Any]:
    """A schema whose `$ref`s go through ``links`` definitions, one after the other."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{links}": {"type": "integer"}}}
