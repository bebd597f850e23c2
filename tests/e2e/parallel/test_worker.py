"""A real worker process, driven over its pipes like the leader does."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from neuron import rpc
from neuron.rpc import ErrorKind
from testkit import ROOT, neuron_command, wait_until
from testkit.worker import WorkerProcess, spawned_worker


@pytest.fixture
def worker() -> Iterator[WorkerProcess]:
    with spawned_worker() as w:
        yield w


@pytest.fixture(scope="module")
def serving_worker() -> Iterator[WorkerProcess]:
    """One worker for the tests that only ask it things and check that it goes on serving."""
    with spawned_worker() as w:
        yield w


GARBAGE = [
    (b"hello\n", ErrorKind.INVALID_JSON),
    (b"\x00\x01\x02\xff\n", ErrorKind.INVALID_JSON),
    (b"\n", ErrorKind.INVALID_JSON),
    (b"42\n", ErrorKind.INVALID_JSON),
    (b'{"op": "teleport", "id": 9}\n', ErrorKind.UNKNOWN_OP),
    (b'{"op": "generate_step", "id": 10, "decode_tokens": "x"}\n', ErrorKind.INVALID_FIELD),
    (b'{"op": "ping"}\n', ErrorKind.INVALID_FIELD),
    (b"x" * (rpc.MAX_LINE_BYTES + 100) + b"\n", ErrorKind.LINE_TOO_LONG),
]


def test_garbage_gets_error_replies_and_the_worker_keeps_serving(serving_worker: WorkerProcess) -> None:
    worker = serving_worker
    for line, kind in GARBAGE:
        worker.send(line)
        reply = worker.reply()
        assert isinstance(reply, rpc.Error), line[:40]
        assert reply.kind == kind, (line[:40], reply)
        assert reply.message.startswith("rank 1:")
    pong = worker.request(rpc.Ping(id=77))
    assert isinstance(pong, rpc.Pong)
    assert (pong.id, pong.rank, pong.world_size, pong.protocol) == (77, 1, 2, rpc.PROTOCOL_VERSION)
    assert pong.pid == worker.proc.pid


def test_error_reply_echoes_the_request_id(serving_worker: WorkerProcess) -> None:
    worker = serving_worker
    reply = worker.request(rpc.GenerateStep(id=5, plan=rpc.StepPlan(prefill=[rpc.Prefill(1, 0, [1], True)])))
    assert isinstance(reply, rpc.Error) and reply.id == 5 and reply.kind == ErrorKind.BAD_STATE
    assert "load_share" in reply.message  # says what to do
    reply = worker.request(rpc.LoadShare(id=6, model_path="/nonexistent", layers=[]))
    assert isinstance(reply, rpc.Error) and reply.id == 6 and reply.kind == ErrorKind.LOAD_FAILED


def test_shutdown_replies_bye_then_exits(worker: WorkerProcess) -> None:
    assert worker.request(rpc.Shutdown(id=3)) == rpc.Bye(id=3)
    assert worker.proc.wait(timeout=30) == 0
    assert worker.proc.stdout is not None and worker.proc.stdout.read() == b""  # nothing but protocol lines


def test_stdin_eof_ends_the_worker(worker: WorkerProcess) -> None:
    assert isinstance(worker.request(rpc.Ping(id=1)), rpc.Pong)
    assert worker.proc.stdin is not None
    worker.proc.stdin.close()
    wait_until(lambda: worker.proc.poll() is not None, 30, "the worker to exit on stdin EOF")
    assert worker.proc.returncode == 0


def test_worker_flag_is_hidden_from_help() -> None:
    out = subprocess.run(neuron_command("--help"), capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert "generate" in out and "--worker" not in out


def test_a_stray_print_lands_in_stderr_not_in_the_protocol(tmp_path: Path) -> None:
    # A library that prints, from Python or straight to fd 1 as C code does (here at exit,
    # via sitecustomize), must not corrupt the stream.
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, os\natexit.register(print, 'STRAY PRINT')\natexit.register(os.write, 1, b'STRAY FD1\\n')\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        neuron_command("--worker", "--rank", "1", "--world-size", "2"),
        cwd=ROOT,
        env=env,
        input=rpc.encode(rpc.Ping(id=1)) + rpc.encode(rpc.Shutdown(id=2)),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert [rpc.decode_reply(line).op for line in done.stdout.splitlines()] == ["pong", "bye"]
    assert b"STRAY PRINT" in done.stderr and b"STRAY FD1" in done.stderr


def test_a_worker_loads_mlx_lm_and_its_rank_without_transformers() -> None:
    """A worker never tokenizes, and transformers' import is most of a CPU-second on each worker's start."""
    done = subprocess.run(
        neuron_command("--worker", "--rank", "1", "--world-size", "2"),
        cwd=ROOT,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
        input=rpc.encode(rpc.Ping(id=1)) + rpc.encode(rpc.Shutdown(id=2)),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.decode().splitlines() if "|" in line}
    assert "mlx_lm.utils" in imported and "transformers" not in imported
    # What a rank imports when it joins (in init) brings it back through no other door.
    rank = "from neuron.cli.worker import models_without_tokenizers as m; m(); import neuron.rank.rank, sys; "
    rank += "print('transformers' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", rank], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "False", loaded.stderr


def _children() -> set[int]:
    """This process's child processes, from every thread's list."""
    return {int(pid) for path in Path("/proc/self/task").glob("*/children") for pid in path.read_text().split()}


def test_workers_started_early_are_handed_over_with_their_env_or_ended() -> None:
    """``neuron serve`` starts this host's workers before its own imports; the pool's spawn takes each (the same
    process) where it asks for the env it was started with, replaces it where not, and the rest are ended."""
    from neuron.launch.launcher import Launcher

    async def scenario() -> None:
        before = _children()
        launcher = Launcher.local(4)
        await launcher.start_early("ring")
        early = _children() - before
        assert len(early) == 3
        taken = await launcher.spawn(1)
        assert taken.process.pid in early
        other = await launcher.spawn(2, {"NEURON_TEST_ENV": "1"})  # not what it was started with: a fresh one
        assert other.process.pid not in early
        await launcher.end_early()  # rank 3's, never taken
        assert _children() - before == {taken.process.pid, other.process.pid}
        fresh = await launcher.spawn(1)  # none left to hand over
        assert fresh.process.pid not in early
        for spawned in (taken, other, fresh):
            spawned.process.kill()
            await spawned.process.wait()
        assert _children() == before

    anyio.run(scenario)
