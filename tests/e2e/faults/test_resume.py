"""Requests that outlive a lost rank, on one host: a worker SIGKILLed or stopped past the step deadline under four
streams (greedy and seeded), a prompt that kills its rank every time, and rank 0 wedged inside the lost group's
collective. One server for all of it: each stream must end as the same request did on the undisturbed server (its
first requests), with no error event.

The multi-host cases (an SSH session cut among them) are in tests/e2e/hosts/test_multihost.py.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from neuron.pool.replacement import LEAVE_S
from testkit import Server
from testkit.faults import CRASH_ENV, ENTRY, OOM_ENV, WEDGE_ENV
from testkit.resume import (
    COMPLETIONS,
    disturb,
    join,
    kill,
    references,
    served,
    shorter,
    start_streams,
    worker_pid,
)
from testkit.server import wait_until

# A prompt of token ids (the completions API takes them) that kills rank 1 whenever a step feeds it.
KILLER = [5, 77, 5, 78]
# The four requests: long enough that the fault lands mid-stream (it lands at 5 chunks), and that the killer's two
# losses, each at the first step that feeds it, cut every stream (the killer test checks that it did).
SHORT = shorter(120)


@pytest.fixture(scope="module")
def wedge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``WEDGE_ENV``'s path: the fault fires once a test creates ``PATH.0`` and ``PATH.1``."""
    return tmp_path_factory.mktemp("wedge") / "wedge"


@pytest.fixture(scope="module")
def tp2(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, wedge: Path) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("resume") / "log"
    args = ("--model", str(tiny_models["qwen3"]), "--tp", "2", "--step-timeout", "3", "--resume-tries", "1")
    env = {CRASH_ENV: f"1:{','.join(map(str, KILLER[1:]))}", WEDGE_ENV: str(wedge)}
    server = Server(*args, log_path=log, module=ENTRY, env=env).start()
    yield server
    assert server.stop() == 0, server.stderr()


@pytest.fixture(scope="module")
def undisturbed(tp2: Server) -> list[str]:
    return references(tp2.url, SHORT)


def test_a_worker_sigkilled_mid_stream_and_every_stream_goes_on(tp2: Server, undisturbed: list[str]) -> None:
    victim = worker_pid(tp2)
    disturb(tp2, undisturbed, kill(victim, signal.SIGKILL), bases=SHORT)
    assert worker_pid(tp2) != victim
    resumed = [e for e in tp2.logs() if e.get("event") == "resumed"]
    assert {e["rank"] for e in resumed} == {1} and all(e["replayed_tokens"] > 0 for e in resumed), resumed
    assert tp2.find_log("recovered", in_process=True) is not None
    assert tp2.find_log("restarting") is None, "the leader process restarted"
    metrics = tp2.metrics()
    assert metrics[("neuron_requests_resumed_total", ())] >= len(SHORT)
    assert metrics[("neuron_replayed_tokens_total", ())] > 0


def test_a_worker_stopped_past_the_deadline_and_every_stream_goes_on(tp2: Server, undisturbed: list[str]) -> None:
    victim = worker_pid(tp2)
    try:
        streams, _ = disturb(tp2, undisturbed, kill(victim, signal.SIGSTOP), bases=SHORT)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the recovery killed it; this only never leaves it frozen
            kill(victim, signal.SIGCONT)()
    assert any(s.keep_alives for s in streams), "no keep-alive while the streams waited"
    assert worker_pid(tp2) != victim


def test_a_prompt_that_kills_its_rank_ends_after_the_tries_and_the_others_go_on(
    tp2: Server, undisturbed: list[str]
) -> None:
    mark = len(tp2.logs())
    streams = start_streams(tp2.url, SHORT)
    wait_until(lambda: all(s.chunks >= 3 for s in streams), 60, "3 chunks on every stream")
    body = {"model": served(tp2.url), "prompt": KILLER, "max_tokens": 8, "stream": True}
    killer = httpx.post(f"{tp2.url}{COMPLETIONS}", json=body, timeout=120)
    join(streams)
    assert "--resume-tries 1" in killer.text and "2 times" in killer.text, killer.text
    for s, expected in zip(streams, undisturbed, strict=True):
        assert s.error is None and s.text == expected, (s.base, s.error)
        assert s.usage is not None and s.usage["completion_tokens"] == s.base["max_tokens"]
    given_up = tp2.find_log("not resumed")
    assert given_up is not None and given_up["losses"] == 2, given_up
    # Each stream was still running at both losses (paused by each, with the killer at the first) and went on.
    logs = tp2.logs()[mark:]
    assert [e["requests"] for e in logs if e.get("event") == "requests paused"] == [len(SHORT) + 1, len(SHORT)], logs
    assert {s.id for s in streams} <= {e["request_id"] for e in logs if e.get("event") == "resumed"}


def test_a_pipeline_stage_lost_and_every_stream_goes_on(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The same promises in a pipeline: rank 1 holds the last stage, rank 0 waits on its hidden states. Last, rank 1
    fails to allocate mid-step (MLX out of memory, injected: ``OOM_ENV``): rank 0 may wait on it inside the
    pipeline's transfer, so the group is replaced as after any lost rank, and the batch resumes on fresh ranks
    within a lower budget, blamed for nothing."""
    oom = tmp_path / "oom"
    args = ("--model", str(tiny_models["qwen3"]), "--pp", "2", "--step-timeout", "3")
    server = Server(*args, log_path=tmp_path / "log", module=ENTRY, env={OOM_ENV: str(oom)}).start()
    try:
        undisturbed = references(server.url, SHORT)
        disturb(server, undisturbed, kill(worker_pid(server), signal.SIGKILL), bases=SHORT)
        victim = worker_pid(server)
        try:
            disturb(server, undisturbed, kill(victim, signal.SIGSTOP), bases=SHORT)
        finally:
            with contextlib.suppress(ProcessLookupError):
                kill(victim, signal.SIGCONT)()
        assert server.find_log("pipeline split", layers=[2, 2]) is not None
        mark = len(server.logs())
        disturb(server, undisturbed, lambda: Path(f"{oom}.1").touch(), bases=SHORT)
        logs = server.logs()[mark:]
        failed = next(e for e in logs if e.get("event") == "out of memory")
        assert failed["rank"] == 1 and failed["paused"] == len(SHORT), failed
        assert any(e.get("event") == "recovered" for e in logs)
        resumed = [e for e in logs if e.get("event") == "resumed"]
        assert {e["reason"] for e in resumed} == {"allocation_failed"} and all(e["losses"] == 0 for e in resumed)
    finally:
        assert server.stop() == 0, server.stderr()


def test_rank0_inside_a_lost_groups_collective_is_freed_or_left_behind_within_the_bound(
    tp2: Server, undisturbed: list[str], wedge: Path
) -> None:
    """Rank 1 dies with its connections' holder (``WEDGE_ENV``), and rank 0 queues a collective after the ring's
    socket threads failed (as a step run ahead does): where that socket's thread has ended, no socket cut frees
    it, and ``LEAVE_S`` after the cut a fresh rank-0 thread takes its place (counted in /metrics); where it has
    not, the sink frees it. Then either every stream resumes in this process, or, where MLX's scheduler keeps the
    fresh thread waiting behind the wedged one's queued work, the leader restarts at once (a probe within
    ``LEAVE_S`` finds it), counted with its cause, and every stream ends with an error that says so.

    The module's last test on its server: the leader may restart. Only what the server logged and counted since
    this test began is its own."""
    mark, abandoned = len(tp2.logs()), tp2.metrics()[("neuron_rank0_threads_abandoned_total", ())]

    def since(event: str) -> dict | None:
        return next((e for e in tp2.logs()[mark:] if e.get("event") == event), None)

    streams = start_streams(tp2.url, SHORT)
    wait_until(lambda: all(s.chunks >= 5 for s in streams), 60, "5 chunks on every stream")
    for rank in (0, 1):
        Path(f"{wedge}.{rank}").touch()
    join(streams)
    cut = since("data plane cut")
    assert cut is not None
    if (left := since("rank 0's thread left behind")) is not None:
        assert left["left_behind"] == 1 and "in step" in left["stuck_in"], left
        freed = _seconds(left["timestamp"]) - _seconds(cut["timestamp"])
        assert LEAVE_S - 0.5 < freed < LEAVE_S + 5, freed  # left behind after LEAVE_S, not sooner, nor later
    if all(s.error is None for s in streams):
        for s, expected in zip(streams, undisturbed, strict=True):
            assert s.error is None and s.text == expected, (s.base, s.error)
        recovered = since("recovered")
        assert recovered is not None and recovered["in_process"], recovered
        assert tp2.metrics()[("neuron_rank0_threads_abandoned_total", ())] - abandoned == (left is not None)
    else:
        restarted = tp2.wait_log("group lost; restarting the leader", timeout=30)
        assert restarted["why"] == "unrecoverable" and "wedged" in restarted["cause"] + str(
            since("recovery failed; restarting the leader")
        ), restarted
        assert all(s.error is not None and "restarting" in str(s.error) for s in streams), streams
        tp2.wait_log("recovered", restarts=restarted["restarts"], timeout=120)
        metrics = tp2.metrics()
        assert metrics[("neuron_leader_restarts_total", (("cause", "unrecoverable"),))] == 1, metrics


def _seconds(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
