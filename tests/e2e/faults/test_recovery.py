"""A rank lost for real (SIGKILL, SIGSTOP) while clients stream, with ``--resume-timeout 0``: clean ends, then the
leader restarts with no operator. (By default the requests resume instead: tests/e2e/faults/test_resume.py.)

``bench/faults.py`` runs the same trial 20 times and reports time-to-ready.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from neuron.launch.watchdog import GRACE_S
from testkit import Server, alive, wait_until
from testkit.faults import ENTRY, SLOW_JOIN_ENV
from testkit.recovery import COMPLETIONS, GREEDY, kill_trial, ready, worker_pid


@pytest.fixture(scope="module")
def tp2(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module: each test leaves it recovered and ready (each waits for that), and counts only
    the recoveries it caused."""
    args = ("--model", str(tiny_models["qwen3"]), "--tp", "2", "--step-timeout", "3", "--resume-timeout", "0")
    server = Server(*args, log_path=tmp_path_factory.mktemp("recovery") / "log")
    yield server.start()
    assert server.stop() == 0, server.stderr()


def _logged(server: Server, event: str) -> list[dict]:
    """The server's log entries of ``event``; the shared server holds the module's earlier tests' too."""
    return [e for e in server.logs() if e.get("event") == event]


def _recovered(server: Server) -> list[dict]:
    return _logged(server, "recovered")


def test_sigkill_a_worker_mid_stream_then_recover(tp2: Server) -> None:
    """Twice: a recovered group is lost and recovered again (each kill at a random chunk), and each recovery is
    counted once."""
    reference = httpx.post(f"{tp2.url}{COMPLETIONS}", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    before = len(_recovered(tp2))
    rng = random.Random(6)
    for _ in range(2):
        kill_trial(tp2, reference, rng, signal.SIGKILL, end_within=2.0)
    recovered = _recovered(tp2)[before:]
    causes = [e["cause"] for e in recovered]
    assert len(causes) == 2 and all("SIGKILL" in c for c in causes), causes
    assert [e["restarts"] for e in recovered] == [before + 1, before + 2]
    assert tp2.metrics()[("neuron_worker_restarts_total", ())] == before + 2


def test_sigstop_a_worker_the_step_deadline_fires_then_recover(tp2: Server) -> None:
    reference = httpx.post(f"{tp2.url}{COMPLETIONS}", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    kill_trial(tp2, reference, random.Random(7), signal.SIGSTOP, end_within=3.0 + 2.0)
    cause = [e["cause"] for e in tp2.logs() if e.get("event") == "recovered"][-1]
    assert "within the deadline" in cause or "stuck" in cause, cause


def test_a_worker_dying_between_requests_turns_ready_off_at_once(tp2: Server) -> None:
    before = len(_recovered(tp2))
    victim = worker_pid(tp2)
    os.kill(victim, signal.SIGKILL)
    lost = tp2.wait_log("worker lost", timeout=10, pid=victim)
    assert lost["rank"] == 1 and "SIGKILL" in lost["status"]
    wait_until(lambda: ready(tp2), 90, "ready again")
    assert len(_recovered(tp2)) == before + 1


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])  # noticed by the process watch, or the deadline
def test_a_non_streaming_request_gets_503_with_retry_after(tp2: Server, sig: signal.Signals) -> None:
    victim = worker_pid(tp2)
    prefills = len(_logged(tp2, "prefill done"))
    replies: list[httpx.Response] = []
    client = threading.Thread(
        target=lambda: replies.append(
            httpx.post(f"{tp2.url}{COMPLETIONS}", json={**GREEDY, "max_tokens": 1900}, timeout=60)
        )
    )
    client.start()
    wait_until(lambda: len(_logged(tp2, "prefill done")) > prefills, 30, "the request running")
    os.kill(victim, sig)
    client.join(timeout=30)
    assert replies and replies[0].status_code == 503, replies
    assert replies[0].headers["retry-after"] == "5"
    assert "rank 1" in replies[0].json()["error"]["message"]
    wait_until(lambda: ready(tp2), 90, "ready again")


def _workers_of(pid: int) -> list[int]:
    """``pid``'s child processes that are neuron workers."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if parent == pid and b"--worker" in command:
                out.append(int(entry.name))
    return out


# Seconds within which a worker whose leader was SIGKILLed is gone: its sentinel's grace, and a margin; a worker
# still starting (importing, before its sentinel runs) reads the EOF once it gets there, on a busy host seconds later.
ORPHAN_BOUND_S = GRACE_S + 2.0
STARTING_BOUND_S = 20.0


@pytest.mark.parametrize("phase", ["spawn", "init", "load", "step"])
def test_a_leader_sigkilled_at_any_phase_leaves_no_worker(
    tiny_models: dict[str, Path], tmp_path: Path, phase: str
) -> None:
    """SIGKILL the leader while its worker starts, sits inside ``mx.distributed.init`` (the leader's rank 0 joins
    late: MLX's init holds the worker's GIL, and its connect retries for about 15 s), loads, or steps: the worker
    is gone within ``ORPHAN_BOUND_S``."""
    args = ("--model", str(tiny_models["qwen3"]), "--tp", "2")
    env = {SLOW_JOIN_ENV: "0:30"} if phase == "init" else {}
    server = Server(*args, log_path=tmp_path / "log", module=ENTRY, env=env)
    try:
        workers: list[int] = []

        def started() -> bool:
            workers[:] = _workers_of(server.process.pid)
            return bool(workers)

        wait_until(started, 60, "the worker process")
        if phase == "init":
            server.wait_log("worker started", rank=1, timeout=60)
            time.sleep(1.0)  # well inside init: the leader joins 30 s late
        elif phase == "load":
            server.wait_log("group ready", timeout=60)
        elif phase == "step":
            server.start()

            def stream() -> None:
                with contextlib.suppress(httpx.TransportError):  # the leader is killed under it, as meant
                    httpx.post(f"{server.url}{COMPLETIONS}", json={**GREEDY, "max_tokens": 500}, timeout=60)

            client = threading.Thread(target=stream, daemon=True)
            client.start()
            server.wait_log("prefill done", timeout=30)
        killed = time.monotonic()
        server.process.kill()
        server.process.wait()
        bound = STARTING_BOUND_S if phase == "spawn" else ORPHAN_BOUND_S
        wait_until(lambda: not any(alive(w) for w in workers), bound, f"workers {workers} to exit")
        print(f"{phase}: the worker was gone {time.monotonic() - killed:.2f} s after the leader's SIGKILL")
    finally:
        server.stop()
