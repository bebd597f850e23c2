"""Settings: the TOML file < NEURON_* environment < flags, and every bad value named before anything loads, as the
command line resolves them. ``neuron serve`` taking them from a file, or refusing it: tests/e2e/serving/
test_config.py."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from neuron.cli.main import _parser
from neuron.config import sources
from neuron.engine.scheduler import Scheduling


def _resolve(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    args = _parser().parse_args(["serve", *argv])
    return args, sources.resolve(args, "serve")


def test_flags_beat_the_environment_which_beats_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "neuron.toml"
    file.write_text('max_batch = 3\nmax_waiting = 5\nprefill_chunk = 7\nbackend = "jaccl"\nstep_timeout = 9\n')
    monkeypatch.delenv("NEURON_LOG_LEVEL", raising=False)
    monkeypatch.setenv("NEURON_MAX_WAITING", "50")
    monkeypatch.setenv("NEURON_PREFILL_CHUNK", "70")
    args, problems = _resolve(["--config", str(file), "--prefill-chunk", "700"])
    assert problems == []
    assert (args.max_batch, args.max_waiting, args.prefill_chunk) == (3, 50, 700)  # file, environment, flag
    assert args.backend == "jaccl" and args.step_timeout == 9.0 and type(args.step_timeout) is float
    assert (args.port, args.host, args.log_level, args.api_key) == (8000, "127.0.0.1", "info", None)  # defaults


def test_the_serving_limits_default_to_the_engines_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One place states each default: what ``serve`` resolves with nothing set is ``Scheduling()``."""
    empty = tmp_path / "neuron.toml"
    empty.write_text("")
    for name in sources.SERVE_SETTINGS:
        monkeypatch.delenv(sources.ENV_PREFIX + name.upper(), raising=False)
    args, problems = _resolve(["--config", str(empty)])
    assert problems == []
    assert {f.name: getattr(args, f.name) for f in dataclasses.fields(Scheduling)} == dataclasses.asdict(Scheduling())


def test_the_config_path_comes_from_the_environment_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "elsewhere.toml"
    file.write_text("max_batch = 2\n")
    monkeypatch.setenv(sources.CONFIG_ENV, str(file))
    args, problems = _resolve([])
    assert problems == [] and args.max_batch == 2


def test_every_problem_is_named_by_where_it_came_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "neuron.toml"
    file.write_text('max_batch = 0\nport = "8000"\ntp = 2.0\nlog_level = "loud"\nmax_bach = 4\n')
    monkeypatch.setenv("NEURON_MAX_WAITING", "many")
    monkeypatch.setenv("NEURON_API_KEY", "  ")
    _, problems = _resolve(["--config", str(file), "--drain-timeout", "-1"])
    assert sorted(problems) == sorted(
        [
            f"unknown setting 'max_bach' in {file}; known: {', '.join(sorted(sources.SERVE_SETTINGS))}",
            f"max_batch in {file} must be at least 1, got 0",
            f"port in {file} must be an integer, got '8000'",
            f"tp in {file} must be an integer, got 2.0",
            f"log_level in {file} must be one of trace, debug, info, warning, error, got 'loud'",
            "NEURON_MAX_WAITING must be an integer, got 'many'",
            "NEURON_API_KEY is empty; give a value or leave it unset",
            "--drain-timeout must be at least 0, got -1.0",
        ]
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("max_batch = \n", "is not valid TOML"),
        (None, "does not exist; pass an existing --config or leave it out"),
    ],
)
def test_an_unreadable_file_is_reported(tmp_path: Path, content: str | None, message: str) -> None:
    file = tmp_path / "neuron.toml"
    if content is not None:
        file.write_text(content)
    _, problems = _resolve(["--config", str(file)])
    assert len(problems) == 1 and message in problems[0] and str(file) in problems[0]
