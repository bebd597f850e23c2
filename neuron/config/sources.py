"""Where each setting's value comes from, and the flags each command takes (the settings are declared in
neuron/config/settings.py).

For ``serve``, a value comes from the first of: the command line, the
environment (``NEURON_`` + the name in capitals, e.g. ``NEURON_MAX_BATCH``),
the TOML file (``--config``, else ``$NEURON_CONFIG``, else
``/etc/neuron/neuron.toml`` when it exists), the default. A packaged server is
configured in its file, a container in its environment, and a person trying
something on the command line; each overrides the one before.

``generate`` reads only its command line: a one-off run should not pick up a
server's settings by surprise.

Every value is checked here, before anything loads, and every problem is
reported at once, named by where it came from (``--port``, ``NEURON_PORT``,
``port in /etc/neuron/neuron.toml``).
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from neuron.config.setting import ENV_PREFIX, Setting
from neuron.config.settings import GROUPS, SETTINGS, names, title

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG",
    "ENV_PREFIX",
    "SETTINGS",
    "Setting",
    "add_arguments",
    "build",
    "names",
    "resolve",
]

DEFAULT_CONFIG = Path("/etc/neuron/neuron.toml")
CONFIG_ENV = "NEURON_CONFIG"
SERVE_SETTINGS = names("serve")
LAYERED = ("serve",)  # the commands that read the environment and the file, not only their flags
MODEL_TABLES = "models"  # a settings file's [[models]]: one table per model a router serves

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """``command``'s flags, in one group per settings object. They default to None, so that ``resolve`` can tell a
    flag given from one left out."""
    groups = {
        # The docstring's first line, less the modules it names: a person reads this.
        group.__name__: parser.add_argument_group(
            title(group),
            re.sub(r" \([^)]*\)\.$", ".", (group.__doc__ or "").split("\n")[0]),
        )
        for group in GROUPS
        if any(SETTINGS[name].group == group.__name__ for name in names(command))
    }
    for name in names(command):
        s = SETTINGS[name]
        group = groups[s.group]
        if s.type is bool:  # a switch: given, it is on; the environment and the file say true or false
            group.add_argument(s.flag, action="store_const", const=True, default=None, help=s.help_for(command))
            continue
        group.add_argument(
            s.flag,
            type=s.type,
            action="append" if s.spec.repeatable else "store",
            default=None,
            choices=s.choices or None,
            help=s.help_for(command) + (f"; one of {', '.join(s.choices)}" if s.choices else ""),
            metavar=s.name.upper(),
        )


def build(cls: type[T], args: argparse.Namespace, **changed: Any) -> T:
    """The settings object ``cls`` (settings.Scheduling, ...) from the resolved ``args``, ``changed`` aside: each of
    its fields that is a setting."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name in SETTINGS}  # type: ignore[arg-type]
    return cls(**{**values, **changed})


def resolve(args: argparse.Namespace, command: str) -> list[str]:
    """Fill each of ``command``'s settings on ``args`` from its layers (see the module's docstring); returns every
    problem found."""
    wanted = names(command)
    layered = command in LAYERED
    problems: list[str] = []
    file: dict[str, Any] = {}
    file_name = ""
    args.model_tables = None
    if layered:
        path, explicit = _config_path(getattr(args, "config", None))
        if path is not None:
            file_name = args.config_file = str(path)
            file, problem = _read_toml(path, explicit)
            if problem:
                return [problem]
            # Several models' tables, each with settings of its own: read by ``router.declared``, not here.
            args.model_tables = file.pop(MODEL_TABLES, None)
            known = set(wanted)
            for key in file:
                if key not in known:
                    problems.append(f"unknown setting {key!r} in {path}; known: {', '.join(sorted(known))}")
    for name in wanted:
        s = SETTINGS[name]
        # Every layer is checked, not only the one that wins: a bad line in the file is a bug even when overridden.
        layers = []
        if (cli := getattr(args, name, None)) is not None:
            layers.append(s.parse(",".join(cli) if isinstance(cli, list) else cli, s.flag))
        if layered and s.env in os.environ:
            layers.append(s.parse(os.environ[s.env], s.env, text=True))
        if name in file:
            layers.append(s.parse(file[name], f"{name} in {file_name}"))
        problems += [problem for _, problem in layers if problem]
        setattr(args, name, layers[0][0] if layers else s.default_for(command))
    return problems


def _config_path(flag: str | None) -> tuple[Path | None, bool]:
    if flag:
        return Path(flag), True
    if env := os.environ.get(CONFIG_ENV):
        return Path(env), True
    return (DEFAULT_CONFIG, False) if DEFAULT_CONFIG.exists() else (None, False)


def _read_toml(path: Path, explicit: bool) -> tuple[dict[str, Any], str | None]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f), None
    except FileNotFoundError:
        if not explicit:
            return {}, None
        return {}, f"config file {path} does not exist; pass an existing --config or leave it out"
    except OSError as e:
        return {}, f"cannot read config file {path}: {e.strerror}"
    except tomllib.TOMLDecodeError as e:
        return {}, f"config file {path} is not valid TOML: {e}"
