"""What a setting is: how one is declared (``setting``, a dataclass field with its ``Spec``), and what the flags,
the environment, the TOML file and the docs read from it (``Setting``: its flag, its variable, its default as a
person reads it, and the parsing and checking of a value). The settings themselves are declared in
``neuron.config.settings``. Plain data, no MLX.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SERVE = ("serve",)
BOTH = ("serve", "generate")
GENERATE = ("generate",)
ENV_PREFIX = "NEURON_"
_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false (1 or 0)"}


@dataclass(frozen=True, slots=True)
class Spec:
    """What ``setting()`` says about a field beyond its name, type and default."""

    help: str
    commands: tuple[str, ...]
    choices: tuple[str, ...] = ()
    at_least: float | None = None
    at_most: float | None = None
    positive: bool = False
    check: Callable[[Any], str | None] | None = None
    unset: str = ""  # what None means, for a setting whose default is None
    why: str = ""  # why the default is what it is, said after it
    per_command: tuple[tuple[str, Any], ...] = ()  # a command whose default differs, and that default
    repeatable: bool = False  # the flag may be given more than once: its values are joined with commas


def setting(
    default: Any,
    help: str,
    *,
    commands: tuple[str, ...] = SERVE,
    choices: tuple[str, ...] = (),
    at_least: float | None = None,
    at_most: float | None = None,
    positive: bool = False,
    check: Callable[[Any], str | None] | None = None,
    unset: str = "",
    why: str = "",
    per_command: dict[str, Any] | None = None,
    repeatable: bool = False,
) -> Any:
    """A settings field: ``default`` is its default, everywhere."""
    spec = Spec(help, commands, choices, at_least, at_most, positive, check, unset, why,
                tuple((per_command or {}).items()), repeatable)  # fmt: skip
    return field(default=default, metadata={"setting": spec})


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting, as read from its field: what the flags, the layers and the docs need."""

    name: str
    type: type  # int, float, str or bool; None is allowed where the default is None
    default: Any
    group: str  # the settings object it lives on
    spec: Spec

    @property
    def help(self) -> str:
        return self.spec.help

    @property
    def commands(self) -> tuple[str, ...]:
        return self.spec.commands

    @property
    def choices(self) -> tuple[str, ...]:
        return self.spec.choices

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def default_for(self, command: str) -> Any:
        return dict(self.spec.per_command).get(command, self.default)

    def shown(self, value: Any) -> str:
        """A default as a person reads it."""
        if value is None:
            return self.spec.unset or "unset"
        if self.type is bool:
            return "on" if value else "off"
        if self.type is float:
            return f"{value:g}"
        if self.name.endswith("_bytes") and value >= 1 << 30 and value % (1 << 30) == 0:
            return f"{value >> 30} GiB ({value})"
        return str(value)

    def shown_default(self, command: str | None = None) -> str:
        """The default; with no command, every command's when they differ."""
        if command is not None:
            return self.shown(self.default_for(command))
        others = "".join(f", {cmd}: {self.shown(value)}" for cmd, value in self.spec.per_command)
        return self.shown(self.default) + others

    def help_for(self, command: str) -> str:
        value = self.default_for(command)
        default = f"default: {self.shown(value)}" if value is None else f"default {self.shown(value)}"
        return f"{self.help} ({default}{': ' + self.spec.why if self.spec.why else ''})"

    def bounds(self) -> str:
        """The values allowed, for the docs."""
        if self.choices:
            return ", ".join(self.choices)
        spec, parts = self.spec, []
        if spec.positive:
            parts.append("> 0")
        if spec.at_least is not None and spec.at_most is not None:
            return f"{spec.at_least:g} to {spec.at_most:g}"
        if spec.at_least is not None:
            parts.append(f"≥ {spec.at_least:g}")
        return ", ".join(parts)

    def parse(self, value: Any, source: str, text: bool = False) -> tuple[Any, str | None]:
        """``value`` as this setting's type (converted from ``text``, the environment's strings), or a problem
        that names ``source``."""
        if text and self.type is bool:
            value = _BOOLEANS.get(value.strip().lower(), value)
        elif text and self.type is not str:
            try:
                value = self.type(value)
            except ValueError:
                return None, f"{source} must be {_TYPE_NAMES[self.type]}, got {value!r}"
        if self.type is float and type(value) is int:
            value = float(value)
        if type(value) is not self.type:
            return None, f"{source} must be {_TYPE_NAMES[self.type]}, got {value!r}"
        if problem := self._problem(value):
            return None, f"{source} {problem}"
        return value, None

    def _problem(self, value: Any) -> str | None:
        spec = self.spec
        if spec.choices and value not in spec.choices:
            return f"must be one of {', '.join(spec.choices)}, got {value!r}"
        if spec.at_least is not None and spec.at_most is not None and not spec.at_least <= value <= spec.at_most:
            return f"must lie in [{spec.at_least:g}, {spec.at_most:g}], got {value}"
        if spec.at_least is not None and value < spec.at_least:
            return f"must be at least {spec.at_least:g}, got {value}"
        if spec.positive and value <= 0:
            return f"must be positive, got {value}"
        return spec.check(value) if spec.check is not None else None
