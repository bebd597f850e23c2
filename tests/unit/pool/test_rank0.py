"""Rank 0's thread alone in its group (TP=1) on the Linux CPU backend runs on one core, beside the thread MLX
starts for its stream (``cpu.one_core``); the event loop's thread is kept on the others while the engine's steps
are short (``Rank0Thread.keep_loop_off``), and gets every core back when rank 0's thread closes."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from neuron.pool.rank0 import Rank0Thread
from neuron.system import cpu

pytestmark = pytest.mark.anyio


def allowed(tid: int) -> str:
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    return status.split("Cpus_allowed_list:")[1].split()[0]


def test_one_core_is_a_core_this_process_may_use() -> None:
    assert len(cpu.one_core()) == 1 and cpu.one_core()[0] in os.sched_getaffinity(0)


@pytest.mark.skipif(
    not cpu.is_linux_cpu_backend() or len(os.sched_getaffinity(0)) < 2, reason="Linux CPU backend, two cores or more"
)
async def test_rank0_alone_shares_one_core_with_mlxs_stream_thread() -> None:
    before = set(os.listdir("/proc/self/task"))
    everything = allowed(threading.get_native_id())
    thread = Rank0Thread(1, None)
    try:
        tid = await thread.call(lambda _: (mx.eval(mx.arange(4) * 2), threading.get_native_id())[1], 30)
        own = allowed(tid)
        started = {int(t) for t in set(os.listdir("/proc/self/task")) - before} - {tid}
        floating = allowed(threading.get_native_id())
        thread.keep_loop_off(True)  # the engine's steps are short
        kept_off = os.sched_getaffinity(threading.get_native_id())
        thread.keep_loop_off(False)  # they are not
        given_back = allowed(threading.get_native_id())
        thread.keep_loop_off(True)
    finally:
        await thread.close(30)
    assert own.isdigit()  # one core
    assert floating == given_back == everything  # the event loop's thread floats unless kept off
    assert kept_off and int(own) not in kept_off
    assert allowed(threading.get_native_id()) == everything  # and gets every core back at close
    assert started, "no thread started beside rank 0's"
    assert {allowed(t) for t in started if Path(f"/proc/self/task/{t}").exists()} == {own}  # MLX's stream thread


async def test_a_rank_0_that_cannot_start_fails_each_call_at_once_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its thread goes on taking jobs, each failed with the reason, rather than leave every caller to wait for a
    thread that is gone (a whole scenario once hung so, to its deadline)."""

    def refuse(*_: object) -> None:
        raise ValueError("no such rank")

    monkeypatch.setattr("neuron.pool.rank0.Rank", refuse)
    thread = Rank0Thread(1, None)
    try:
        with pytest.raises(RuntimeError, match=re.escape("rank 0 could not start: ValueError('no such rank')")):
            await thread.call(lambda rank: rank, 30)
    finally:
        await thread.close(30)
