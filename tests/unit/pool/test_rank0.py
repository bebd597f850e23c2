"""Rank 0's thread alone in its group (TP=1) on the Linux CPU backend runs on one core, beside the thread MLX
starts for its stream (``cpu.one_core``), while the engine's steps are short or not yet timed, and the event loop's
thread is kept on the other cores while they are short; where they are long, the two threads and the loop float
over every core (``Rank0Thread.place``). The loop gets every core back when rank 0's thread closes."""

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
async def test_rank0_alone_shares_one_core_with_mlxs_stream_thread_until_its_steps_are_long() -> None:
    before = set(os.listdir("/proc/self/task"))
    everything = allowed(threading.get_native_id())
    thread = Rank0Thread(1, None)
    seen: dict[str, tuple[str, set[str], str]] = {}  # rank 0's cores, its stream thread's, the loop's, by placing

    def look(when: str) -> None:
        started = {int(t) for t in set(os.listdir("/proc/self/task")) - before} - {tid}
        threads = {allowed(t) for t in started if Path(f"/proc/self/task/{t}").exists()}
        seen[when] = (allowed(tid), threads, allowed(threading.get_native_id()))

    try:
        tid = await thread.call(lambda _: (mx.eval(mx.arange(4) * 2), threading.get_native_id())[1], 30)
        look("started")
        for when, short in (("short", True), ("long", False), ("short again", True), ("not timed", None)):
            thread.place(short)
            look(when)
        thread.place(True)
    finally:
        await thread.close(30)
    core = seen["started"][0]
    assert core.isdigit()  # one core
    assert seen["started"] == (core, {core}, everything), "no thread started beside rank 0's, or not on its core"
    assert seen["short"][:2] == seen["short again"][:2] == (core, {core})
    kept_off = seen["short"][2]
    assert kept_off != everything and core not in kept_off.replace("-", ",").split(",")  # the loop off its core
    assert seen["long"] == (everything, {everything}, everything)  # all float
    assert seen["not timed"] == (core, {core}, everything)
    assert allowed(threading.get_native_id()) == everything  # the loop gets every core back at close


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
