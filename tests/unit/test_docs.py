"""The README and the docs' pages name only what exists: files, flags, NEURON_* variables, HTTP routes and metrics;
they never state a setting's default (the settings reference does, from the declaration); and the README's test
command is the one CI runs. ``mkdocs build --strict``, in that command, checks the links and the pages."""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path

import pytest

from neuron import metrics
from neuron.cli.main import _parser
from neuron.cli.reference import PAGES as GENERATED
from neuron.cli.reference import openapi
from neuron.config.settings import SETTINGS
from neuron.router.metrics import RouterMetrics
from testkit import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SPANS = re.compile(r"`([^`\n]+)`")
FENCES = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
# Where a path in the text is a place on a host, not in this repository.
# Flags of the other commands the pages show (pip's, in the set-up command).
OTHER_TOOLS = {"--no-deps"}
# Where the repository's own files are, for a bare ``name.py``.
SOURCES = ("neuron", "tests", "testkit", "bench", "scripts", "packaging")
HOST_PATHS = ("/etc/", "/var/", "/opt/", "/proc/", "/usr/", "/Volumes/", "/models/", "/dev/", "/sys/", "/tmp/", "~/")


@functools.cache
def _flags() -> frozenset[str]:
    found: set[str] = set()
    parsers = [_parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            found.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
    return frozenset(found | OTHER_TOOLS)


@functools.cache
def _files() -> frozenset[str]:
    return frozenset(path.name for top in SOURCES for path in (ROOT / top).rglob("*"))


@functools.cache
def _variables() -> frozenset[str]:
    named = {s.env for s in SETTINGS.values()}
    for path in (ROOT / "neuron").rglob("*.py"):
        named.update(re.findall(r"\"(NEURON_[A-Z_]+)\"", path.read_text()))
    return frozenset(named)


@functools.cache
def _metric_names() -> frozenset[str]:
    registries = (metrics.REGISTRY, RouterMetrics().registry)  # a server's, and a router's of several models
    return frozenset({metric.name for registry in registries for metric in registry.collect()})


@functools.cache
def _routes() -> frozenset[str]:
    return frozenset({re.sub(r"\{[^}]*\}", "{}", path) for path in openapi()["paths"]})


def _expand(text: str) -> list[str]:
    """``neuron_prefix_cache_{hits,misses}_total`` as the names it stands for (``name{rank,host}``: its labels)."""
    text = re.sub(r"\{[^{}]*\}$", "", text)
    match = re.search(r"\{([^{}]*,[^{}]*)\}", text)
    if match is None:
        return [text]
    return [n for part in match[1].split(",") for n in _expand(text[: match.start()] + part + text[match.end() :])]


def _problems(page: Path) -> list[str]:
    text = page.read_text()
    where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    flags, variables, names, routes = _flags(), _variables(), _metric_names(), _routes()
    spans = SPANS.findall(text)
    commands = [line for block in FENCES.findall(text) for line in block.splitlines()]
    commands += [span for span in spans if span.startswith(("neuron ", ".venv/bin/neuron "))]
    out = []
    for span in spans:
        if re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", span) and (ROOT / span.split("/")[0]).exists() and "/" in span:
            if not (ROOT / span).exists():
                out.append(f"{where}: names {span}, which does not exist")
        elif re.fullmatch(r"\w+\.py", span) and span not in _files():
            out.append(f"{where}: names {span}, which no file of the repository is")
        if (flag := re.match(r"--[a-z][a-z-]*", span)) and flag[0] not in flags:
            out.append(f"{where}: names {flag[0]}, which neuron does not take")
        if (route := re.fullmatch(r"(?:GET |POST )?(/v1/[\w./{}-]*|/[a-z.]+)", span)) and not span.startswith(
            HOST_PATHS
        ):
            path = re.sub(r"\{[^}]*\}", "{}", route[1])
            if path.startswith("/v1/") or route[0] != route[1]:
                if path not in routes:
                    out.append(f"{where}: names the route {route[0]}, which neuron does not serve")
    for line in commands:
        if re.match(r"\s*(\S*/)?neuron ", line):
            given = re.findall(r"(?<![\w-])--[a-z][a-z-]*", line)
            out += [f"{where}: runs neuron with {f}, which it does not take" for f in given if f not in flags]
        for url in re.findall(r"https?://(?:127\.0\.0\.1|localhost)(?::\d+)?(/[\w./{}-]*)", line):
            if url not in routes and not any(route.startswith(url.rstrip("/") + "/") for route in routes):
                out.append(f"{where}: calls {url}, which neuron does not serve")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # another site's
        linked = (page.parent / target).resolve()
        generated = linked.is_relative_to(ROOT / "docs") and linked.relative_to(ROOT / "docs").as_posix() in GENERATED
        if not linked.exists() and not generated:
            out.append(f"{where}: links to {target}, which does not exist")
    for variable in set(re.findall(r"\bNEURON_[A-Z][A-Z_]*", text)) - variables:
        out.append(f"{where}: names {variable}, which neuron does not read")
    for name in {n for token in re.findall(r"\bneuron_[a-z][a-z0-9_{},]*(?<![{,])", text) for n in _expand(token)}:
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        if name not in names and base not in names:
            out.append(f"{where}: names the metric {name}, which neuron does not export")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_names_only_what_exists(page: Path) -> None:
    assert _problems(page) == []


def test_the_check_finds_what_no_longer_exists(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Files `neuron/rank/hooks.py` and `hooks.py`, the flag `--max-batches`, `NEURON_MAX_BATCHES`, "
        "`POST /v1/chat/complete`, the metric `neuron_requests_failed_total`, "
        "`neuron_prefix_cache_{hits,misss}_total`, [the old page](docs/gone.md).\n\n```sh\nneuron serve --prot 8000\n"
        "curl http://127.0.0.1:8000/v1/chat/complete\n```\n"
    )
    found = " ".join(_problems(page))
    names = ["neuron/rank/hooks.py", "hooks.py,", "--max-batches", "NEURON_MAX_BATCHES", "/v1/chat/complete,"]
    names += [
        "neuron_requests_failed_total",
        "neuron_prefix_cache_misss_total",
        "--prot",
        "calls /v1/chat/complete",
        "docs/gone.md",
    ]
    for gone in names:
        assert gone in found + ",", f"{gone} not found in {found}"
    assert "neuron_prefix_cache_hits_total" not in found


def _repeated_defaults(text: str) -> list[str]:
    """A setting's flag, variable or key followed, in the same sentence, by "default" and its default."""
    found = []
    for s in SETTINGS.values():
        if s.default is None or s.type is bool:
            continue
        shown = {s.shown_default("serve" if "serve" in s.commands else "generate"), str(s.default)}
        names = "|".join(re.escape(n) for n in (s.flag, s.env, f"`{s.name}`"))
        values = "|".join(re.escape(v) for v in shown)
        pattern = rf"({names})(?![\w-])[^.;]{{0,80}}?\bdefault\b:?\s*(?:is\s+)?`?({values})(?![\w.])"
        found += [f"{s.flag}: ...{m[0]}..." for m in re.finditer(pattern, text)]
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_leaves_the_defaults_to_the_settings_reference(page: Path) -> None:
    assert _repeated_defaults(page.read_text()) == [], "link to the settings reference instead"


def test_the_default_check_finds_a_repeated_default() -> None:
    assert _repeated_defaults("up to `--max-batch` (default 8) at once; `--drain-timeout` (default 30 s)")
    assert not _repeated_defaults("up to `--max-batch` at once (see the reference); `--max-n 3` asks for 3")


def test_the_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = [block.strip() for block in FENCES.findall(readme) if block.startswith("sh scripts/fast-blas")]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert len(commands) == 2, "the README's two commands: set up and run, set up and test"
    assert commands[1] == ci, "the README's test command and .ci/run's last line differ"
    assert "mkdocs build --strict" in ci and commands[1].endswith("-m pytest")
    for page in PAGES[1:]:  # a page that shows them shows the very same
        shown = [
            block.strip() for block in FENCES.findall(page.read_text()) if block.startswith("sh scripts/fast-blas")
        ]
        assert set(shown) <= set(commands), f"{page.relative_to(ROOT)} shows a set-up command the README does not"
