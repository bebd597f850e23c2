"""Shared fixtures: tiny random-weight models with a real tokenizer, the embedded SmolLM2, served models; the test
tiers (pyproject's markers: ``unit`` is the fast one, the rest is ``e2e``, ``hosts``, ``packaging``, ``soak``).

The helpers behind them live in ``testkit`` (shared with the benchmarks); they are re-exported here for the tests
that import them from ``conftest``.
"""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from neuron.system import descriptors
from testkit import (
    CHAT_TEMPLATE,
    ROOT,
    SPECIALS,
    TOOLS_TEMPLATE,
    DatagramSink,
    Server,
    alive,
    make_tiny_model,
    neuron_command,
    run_neuron,
    serving,
    sse_events,
    tcp_sockets,
    wait_until,
    with_template,
)

__all__ = [
    "CHAT_TEMPLATE",
    "ROOT",
    "SPECIALS",
    "TOOLS_TEMPLATE",
    "DatagramSink",
    "Server",
    "alive",
    "make_tiny_model",
    "neuron_command",
    "run_neuron",
    "serving",
    "sse_events",
    "tcp_sockets",
    "wait_until",
    "with_template",
]

os.environ.setdefault("NEURON_LOG_LEVEL", "warning")

# Test modules import mlx_lm.utils, which would lower this process's hard descriptor limit for good; the
# idle-connection tests open thousands of sockets, and start servers under limits of their own.
descriptors.import_mlx_lm()


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Trip(BaseModel):
    destination: Address
    stops: list[Address] = Field(max_length=2)
    nights: int = Field(ge=1, le=30)


class Parcel(BaseModel):
    class Address(BaseModel):  # a `$defs` name the other tool uses too, for another shape
        zip: str = Field(pattern="^[0-9]{5}$")

    to: Address


def pydantic_tool(name: str, model: type[BaseModel]) -> dict:
    """A function tool as agent SDKs declare one: parameters from a pydantic model, nested models in `$defs`."""
    return {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}


PLAN_TRIP = pydantic_tool("plan_trip", Trip)
SHIP_PARCEL = pydantic_tool("ship_parcel", Parcel)

# A Qwen3-style thinking model: `<think>` and `</think>` are tokens of its own (added, not special, as Qwen3's), its
# template renders tools and opens the thinking section for the model unless `enable_thinking` is false.
THINKING_TEMPLATE = TOOLS_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}",
)


def make_thinking_model(folder: Path) -> Path:
    """A tiny qwen3 whose tokenizer has thinking markers and whose template thinks (THINKING_TEMPLATE)."""
    from tokenizers import AddedToken, Tokenizer

    make_tiny_model(folder, "qwen3", seed=3, vocab=len(SPECIALS) + 256 + 8)  # room for the two markers
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    return folder


@pytest.fixture(scope="session")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The thinking model served on one rank, for the whole session (reasoning and the Messages API share it)."""
    model = make_thinking_model(tmp_path_factory.mktemp("thinking") / "tiny-thinker")
    with serving(tmp_path_factory, "--model", str(model), "--prefill-chunk", "64") as server:
        yield server


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The embedded SmolLM2 served with the defaults on one rank, for the whole session: the slowest of the served
    models to start, and structured output and agents' tools ask the same server the same way."""
    with serving(tmp_path_factory) as server:
        yield server


# The embedded SmolLM2, found with no --model, asked one question on one rank. test_cli checks the answer; the
# pipeline and multi-host tests hold their splits to the same words. One run for the session.
PARIS = ("--chat", "--max-tokens", "24", "What is the capital of France?")


@pytest.fixture(scope="session")
def smollm2_paris() -> subprocess.CompletedProcess[str]:
    done = run_neuron("generate", *PARIS)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen3")}


TP1_TOKENS = 32  # greedy tokens in ``tiny_tp1``'s reference


@pytest.fixture(scope="session")
def tiny_tp1(tiny_models: dict[str, Path]) -> dict[str, dict]:
    """Each tiny model on one rank in a fresh leader (tests/leader_scenarios.py's ``generate``): its greedy tokens
    and its parameter count, the reference the pool and pipeline tests hold their splits to; run once for the
    session."""
    from test_pool import scenarios_side_by_side

    runs = scenarios_side_by_side(*(("generate", str(path), 1, TP1_TOKENS) for path in tiny_models.values()))
    return dict(zip(tiny_models, runs, strict=True))


@pytest.fixture(scope="session")
def tiny_alone(tiny_models: dict[str, Path]) -> Callable[[str], str]:
    """What ``neuron generate --max-tokens 24 hello`` prints on one rank, by tiny model: each run once for the
    session (the multi-host and push tests hold their splits to it)."""
    texts: dict[str, str] = {}

    def text(arch: str) -> str:
        if arch not in texts:
            done = run_neuron("generate", "--model", str(tiny_models[arch]), "--max-tokens", "24", "hello")
            assert done.returncode == 0, done.stderr[-3000:]
            texts[arch] = done.stdout
        return texts[arch]

    return text


Once = Callable[[object, Callable[[], Any]], Any]


@pytest.fixture(scope="module")
def once() -> Once:
    """``once(key, make)``: what ``make`` gives, made the first time the module asks for ``key``. A parametrized
    module fixture is made again each time pytest's order (which groups the tests by their servers) comes back to
    one of its values; a model and its reference made through this are made once for the module."""
    made: dict[object, Any] = {}

    def get(key: object, make: Callable[[], Any]) -> Any:
        if key not in made:
            made[key] = make()
        return made[key]

    return get


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from neuron.models.folder import resolve

    return resolve(None)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# One rank; every layer sliced over two; two pipeline stages, whose decode runs in two micro-batches.
SPLITS = {"tp1": ("--tp", "1"), "tp2": ("--tp", "2"), "pp2": ("--pp", "2", "--micro-batches", "2")}


@pytest.fixture(scope="module", params=list(SPLITS.values()), ids=list(SPLITS))
def split_qwen3(
    request: pytest.FixtureRequest, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The tiny qwen3 served three ways, one server per module: one rank; every layer sliced over two; two
    pipeline stages, whose decode runs in two micro-batches. Prompts are fed 16 tokens a step, so that long ones
    take several steps."""
    with serving(tmp_path_factory, "--model", str(tiny_models["qwen3"]), "--prefill-chunk", "16", *request.param) as s:
        yield s


# The tiers. ``unit`` is the fast one: no model, no subprocess. Everything else is end to end unless it names its
# own slower tier; plain ``pytest`` runs every tier.
TIERS = ("unit", "e2e", "hosts", "packaging", "soak")
MODEL_FIXTURES = frozenset({"tiny_models", "tiny_alone", "smollm2", "smollm2_paris", "split_qwen3"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tiers = [name for name in TIERS if item.get_closest_marker(name)]
        if not tiers:
            item.add_marker(pytest.mark.e2e)
        elif len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {' and '.join(tiers)}: a test belongs to one tier")
        elif tiers == ["unit"] and (models := MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))):
            raise pytest.UsageError(f"{item.nodeid} is marked unit but uses {', '.join(sorted(models))}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Compile neuron and testkit once, before the end-to-end tests start their hundreds of processes.

    Where PYTHONDONTWRITEBYTECODE is set (as in a CI job's environment), no process leaves bytecode behind, so every
    leader and worker of a fresh clone would compile each module it imports again; bytecode written here is read
    by them all.
    """
    if sys.dont_write_bytecode and any(not item.get_closest_marker("unit") for item in session.items):
        for package in ("neuron", "testkit"):
            compileall.compile_dir(ROOT / package, quiet=1)


class _NoSubprocess:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("a unit test starts no process: mark it e2e, or test the decision without one")


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("unit"):
        monkeypatch.setattr(subprocess, "Popen", _NoSubprocess)
