"""The fixtures every feature's tests share (tiny random-weight models with a real tokenizer, the embedded SmolLM2,
served models) and the hooks that keep the tiers: pyproject's markers, where ``unit``, the fast tier, is the folder
tests/unit/ (``tier_problem`` in testkit/layout.py), and the rest is ``e2e`` unless it names a slower tier of its own
(``hosts``, ``packaging``, ``soak``). A fixture one feature's folder alone uses lies in that folder's conftest.py;
the helpers behind them all lie in ``testkit``.
"""

from __future__ import annotations

import compileall
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron import log
from neuron.system import cpu, descriptors
from testkit import ROOT, Server, run_neuron, serving
from testkit.layout import TIERS, UNIT, tier_problem
from testkit.models import make_thinking_model, make_tiny_model
from testkit.server import PARIS, SPLITS
from testkit.system import Journal

TESTS = Path(__file__).resolve().parent

os.environ.setdefault("NEURON_LOG_LEVEL", "warning")
# The suite runs a file per core and one more (``pytest_xdist_auto_num_workers``). A leader alone on its host keeps
# OpenBLAS's default of a thread per core, and between calls the idle one spins (sched_yield) on the core the other
# files' processes need. Ranks given cores (``--cpus``) still set their own count (``cpu.set_blas_threads``).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Test modules import mlx_lm.utils, which would lower this process's hard descriptor limit for good; the
# idle-connection tests open thousands of sockets, and start servers under limits of their own.
descriptors.import_mlx_lm()
# Importing mlx-vlm sets TRANSFORMERS_VERBOSITY=error in this process's environment, which every server and command
# the tests start would inherit: they would run with transformers' warnings silenced, as an operator's never do (a
# warning once broke the leader's JSON log unseen). Imported here, once, so that it is taken back before any starts.
import mlx_vlm  # noqa: E402, F401

os.environ.pop("TRANSFORMERS_VERBOSITY", None)


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


@pytest.fixture(scope="session")
def smollm2_paris() -> subprocess.CompletedProcess[str]:
    """``neuron generate`` asked PARIS's question (testkit/server.py), once for the session."""
    done = run_neuron("generate", *PARIS)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from neuron.models.folder import resolve

    return resolve(None)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=list(SPLITS.values()), ids=list(SPLITS))
def split_qwen3(
    request: pytest.FixtureRequest, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The tiny qwen3 served three ways, one server per module: one rank; every layer sliced over two; two
    pipeline stages, whose decode runs in two micro-batches. Prompts are fed 16 tokens a step, so that long ones
    take several steps."""
    with serving(tmp_path_factory, "--model", str(tiny_models["qwen3"]), "--prefill-chunk", "16", *request.param) as s:
        yield s


@pytest.fixture
def journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Journal]:
    """A stand-in for journald's socket, which this process and the neurons it starts log to."""
    with Journal(tmp_path / "journal") as sink:
        monkeypatch.setenv(log.JOURNAL_SOCKET_ENV, str(sink.path))
        yield sink


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): a worker per core and one more, up to ``--maxprocesses``. A test spends
    part of its time waiting on the processes it started (a server's start, a stream, a worker's exit), which a
    worker more fills (BENCHMARKS.md, "The suite a worker more")."""
    return len(cpu.allowed_cores()) + 1


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by the markers given here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        where = item.path.relative_to(TESTS)
        tiers = [name for name in TIERS if item.get_closest_marker(name)]
        if problem := tier_problem(where, tiers, getattr(item, "fixturenames", ())):
            raise pytest.UsageError(f"{item.nodeid} {problem}")
        if where.parts[0] == UNIT:
            item.add_marker(pytest.mark.unit)
        elif not tiers:
            item.add_marker(pytest.mark.e2e)


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
        raise AssertionError("a unit test starts no process: move it to tests/e2e/, or test the decision without one")


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("unit"):
        monkeypatch.setattr(subprocess, "Popen", _NoSubprocess)
