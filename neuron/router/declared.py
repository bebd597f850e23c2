"""The models a router serves, as the operator declared them: repeated ``--model``, or the file's ``[[models]]``
tables, each with its own source, split and residency. Every problem is found at start, named by its entry. No
I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from neuron.config.settings import SETTINGS, default
from neuron.models.folder import model_id

# What a table may set for its model alone: the split and what is served beside it. Every other setting is the
# server's and applies to every model.
OWN_SETTINGS = ("tp", "pp", "pp_layers", "hosts", "adapter", "draft_model")
TABLE_KEYS = ("name", "model", "preload", "keep_alive", *OWN_SETTINGS)
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


@dataclass(frozen=True, slots=True)
class Declared:
    """One model: the name clients send as ``model``, where it comes from, its own settings (each a setting's
    name to its value), whether it loads at start, and how long it may stay idle before it unloads (None:
    never)."""

    name: str
    source: str
    own: tuple[tuple[str, Any], ...] = ()
    preload: bool = default("preload")
    keep_alive: float | None = None

    def adapters(self) -> list[str]:
        """The LoRA adapters served as models of this one's (``NAME=PATH``): requests naming them come here."""
        value = dict(self.own).get("adapter") or ""
        return [item.split("=", 1)[0].strip() for item in value.split(",") if "=" in item]


def duration(value: Any, where: str) -> tuple[float | None, str | None]:
    """Seconds from a number or Ollama's text (``"5m"``, ``"30s"``, ``"1h"``); a negative one means never."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None, f'{where} must be seconds or a duration such as "5m", got {value!r}'
    if isinstance(value, str):
        if value.strip().startswith("-"):
            return None, None
        match = DURATION.match(value)
        if match is None:
            return None, f'{where} must be seconds or a duration such as "5m" (ms, s, m, h), got {value!r}'
        return float(match[1]) * UNITS[match[2]], None
    return (None, None) if value < 0 else (float(value), None)


def from_flags(sources: list[str], preload: bool, keep_alive: float | None) -> list[Declared]:
    """``--model`` given more than once: each model split as the server's own settings say."""
    return [Declared(model_id(source), source, preload=preload, keep_alive=keep_alive) for source in sources]


def from_tables(tables: Any, where: str, keep_alive: float | None) -> tuple[list[Declared], list[str]]:
    """The file's ``[[models]]`` tables, and every problem in them, each naming its entry."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        return [], [f"models in {where} must be [[models]] tables, each with model = SOURCE"]
    declared, problems = [], []
    for i, table in enumerate(tables, 1):
        entry = f"[[models]] entry {i} in {where}"
        if unknown := sorted(set(table) - set(TABLE_KEYS)):
            problems.append(f"{entry} has unknown keys {', '.join(unknown)}; a table takes {', '.join(TABLE_KEYS)}")
        source = table.get("model")
        if not isinstance(source, str) or not source:
            problems.append(f"{entry} needs model = SOURCE (a folder, a .gguf file or a Hub name)")
            continue
        own = []
        for name in OWN_SETTINGS:
            if name in table:
                value = table[name]
                if name == "adapter" and isinstance(value, list):
                    value = ",".join(str(v) for v in value)
                parsed, problem = SETTINGS[name].parse(value, f"{name} of {entry}")
                if problem:
                    problems.append(problem)
                own.append((name, parsed))
        preload = table.get("preload", False)
        if not isinstance(preload, bool):
            problems.append(f"preload of {entry} must be true or false, got {preload!r}")
        idle, problem = (
            duration(table["keep_alive"], f"keep_alive of {entry}")
            if "keep_alive" in table
            else (
                keep_alive,
                None,
            )
        )
        if problem:
            problems.append(problem)
        name = table.get("name", model_id(source))
        if not isinstance(name, str) or not name.strip():
            problems.append(f"name of {entry} must be a non-empty string, got {name!r}")
            continue
        declared.append(Declared(name, source, tuple(own), preload is True, idle))
    return declared, problems


def conflicts(declared: list[Declared]) -> list[str]:
    """Names that two entries claim, a model's own or one of its adapters'."""
    owners: dict[str, list[str]] = {}
    for model in declared:
        for name in (model.name, *model.adapters()):
            owners.setdefault(name, []).append(model.source)
    return [
        f"the model name {name!r} is declared more than once ({', '.join(sources)}); give each [[models]] entry a "
        "name of its own (name = ...)"
        for name, sources in owners.items()
        if len(sources) > 1
    ]
