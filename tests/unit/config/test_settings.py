"""Each setting is declared once (neuron/config/settings.py): its flag, its environment variable, its TOML key, the
docs' table and the settings objects all follow that one declaration, and no default is written a second time,
nor in the packaged config. A default changed in its declaration, in a copy of the package:
tests/e2e/repository/test_settings.py."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

from neuron.cli.main import _parser
from neuron.config import sources
from neuron.config.settings import SETTINGS
from testkit import ROOT

# A class or function that holds a setting under a name of its own: (class or function, field or argument) -> it.
ALIASES = {
    ("Deadlines", "step"): "step_timeout",
    ("configure", "level"): "log_level",
    ("configure", "fmt"): "log_format",
}
# The declarations themselves, and the API's sampling defaults that generate's sampling settings read.
DECLARING = {ROOT / "neuron" / "config" / "settings.py", ROOT / "neuron" / "sampling_params.py"}


def _second_literals(path: Path, root: Path = ROOT) -> list[str]:
    """Each place in ``path`` that gives a setting's name its default as a literal: a class field, a keyword's
    default, a module constant."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        bound: list[tuple[str, ast.expr | None, int]] = []
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    name = ALIASES.get((node.name, item.target.id), item.target.id)
                    bound.append((name, item.value, item.lineno))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
            bound += [(ALIASES.get((node.name, a.arg), a.arg), d, node.lineno) for a, d in pairs]
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            bound.append((node.targets[0].id.lower(), node.value, node.lineno))
        elif isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(node.args[0], ast.Constant):
            # os.environ.get("NEURON_PORT", 8000): the variable's default
            named = {s.env: s.name for s in SETTINGS.values()}.get(node.args[0].value)  # type: ignore[arg-type]
            if named is not None:
                bound.append((named, node.args[1], node.lineno))
        for name, value, line in bound:
            setting = SETTINGS.get(name)
            if setting is None or setting.default is None or value is None:
                continue
            try:
                literal = ast.literal_eval(value)
            except ValueError:
                continue  # read from somewhere: not a second statement of the default
            if literal == setting.default:
                found.append(f"{path.relative_to(root)}:{line}: {name} = {literal!r} repeats {setting.flag}'s default")
    return found


def test_no_default_is_written_twice() -> None:
    found = [hit for path in sorted((ROOT / "neuron").rglob("*.py")) if path not in DECLARING
             for hit in _second_literals(path)]  # fmt: skip
    assert found == [], "read the default from neuron.config.settings instead:\n" + "\n".join(found)


def test_the_check_finds_a_second_literal(tmp_path: Path) -> None:
    """The check above can fail: a class that states the port's default, or a keyword default of the step
    timeout's alias, is found."""
    planted = tmp_path / "neuron" / "planted.py"
    planted.parent.mkdir()
    planted.write_text(
        "class Options:\n    port: int = 8000\n    host: str = 'localhost'\n\n"
        "class Deadlines:\n    step: float = 120.0\n\n"
        "def serve(max_connections: int = 1024) -> None: ...\n"
        "def configure(level: str = 'info') -> None: ...\n"
        "LEVEL = os.environ.get('NEURON_LOG_LEVEL', 'info')\n"
    )
    hits = _second_literals(planted, tmp_path)
    assert [hit.split(": ", 1)[1] for hit in hits] == [
        "port = 8000 repeats --port's default",
        "step_timeout = 120.0 repeats --step-timeout's default",
        "max_connections = 1024 repeats --max-connections's default",
        "log_level = 'info' repeats --log-level's default",
        "log_level = 'info' repeats --log-level's default",
    ]


def test_the_packaged_config_sets_only_what_differs_from_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """packaging/neuron.toml is read as any config is, and states no default: not as a value, nor in a comment."""
    packaged = ROOT / "packaging" / "neuron.toml"
    for s in SETTINGS.values():
        monkeypatch.delenv(s.env, raising=False)
    args = _parser().parse_args(["serve", "--config", str(packaged)])
    assert sources.resolve(args, "serve") == []
    values = tomllib.loads(packaged.read_text())
    commented = {
        name: tomllib.loads(line.lstrip("# "))[name]
        for line in packaged.read_text().splitlines()
        if (found := re.match(r"#\s*(\w+) = ", line)) and (name := found[1]) in SETTINGS
    }
    for source in (values, commented):
        repeated = [name for name, value in source.items() if value == SETTINGS[name].default]
        assert repeated == [], f"{packaged} repeats the defaults of {repeated}"
