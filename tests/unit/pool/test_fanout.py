"""The fan-out's rules, with scripted workers behind real ``Link``s and a real rank-0 thread: every worker that was
sent a request is drained exactly once, every failing rank is named with its host, and which failures break the
group. No process, no model; tests/e2e/parallel/test_pool.py shows the same rules with real workers.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from neuron import rpc
from neuron.pool.fanout import FanOut, PoolError
from neuron.pool.link import Link
from neuron.pool.rank0 import Rank0Thread
from neuron.rank.rank import RankError
from neuron.rpc import ErrorKind

pytestmark = pytest.mark.anyio

HOSTS = ["leader", "mac2", "mac3"]
DEADLINE = 5.0

Answer = Callable[[rpc.Request], "rpc.Reply | bytes | int | None"]


def cleared(request: rpc.Request) -> rpc.Reply:
    return rpc.KvCacheCleared(id=request.id)


class ScriptedWorker:
    """A worker process standing in for ``neuron --worker``: each request written to its stdin is answered with
    what ``answer`` makes of it: a reply, raw bytes, an exit code (the process dies), or None (it hangs)."""

    def __init__(self, rank: int, answer: Answer) -> None:
        self.pid = 4000 + rank
        self.returncode: int | None = None
        self.answer = answer
        self.requests: list[rpc.Request] = []
        self._out, self.stdout = anyio.create_memory_object_stream[bytes](16)
        self.stdin = self

    async def send(self, data: bytes) -> None:
        if self.returncode is not None:
            raise anyio.BrokenResourceError
        request = rpc.decode_request(data)
        self.requests.append(request)
        match self.answer(request):
            case int(code):
                self.returncode = code
                self._out.close()
            case bytes(line):
                await self._out.send(line)
            case None:
                pass
            case reply:
                await self._out.send(rpc.encode(reply))

    async def wait(self) -> int | None:
        return self.returncode


@pytest.fixture
async def rank0() -> AsyncIterator[Rank0Thread]:
    thread = Rank0Thread(len(HOSTS), None)
    yield thread
    await thread.close(DEADLINE)


def fan_out(rank0: Rank0Thread, *answers: Answer) -> tuple[FanOut, list[ScriptedWorker]]:
    fan = FanOut(rank0, HOSTS)
    workers = [ScriptedWorker(rank, answer) for rank, answer in enumerate(answers, start=1)]
    fan.workers = [Link(w.pid - 4000, HOSTS[w.pid - 4000], w, BufferedByteReceiveStream(w.stdout)) for w in workers]  # type: ignore[arg-type]
    return fan, workers


def clear(rank: int, id: int) -> rpc.Request:
    return rpc.ClearKvCache(id=id, prefixes=False)


def rank0_ok(rank: Any) -> str:
    return "rank 0 done"


async def test_every_rank_answers_and_results_come_by_rank(rank0: Rank0Thread) -> None:
    fan, workers = fan_out(rank0, cleared, cleared)
    results = await fan("clear_kv_cache", clear, rank0_ok, DEADLINE)
    assert results[0] == "rank 0 done" and [type(results[r]) for r in (1, 2)] == [rpc.KvCacheCleared] * 2
    ids = [w.requests[0].id for w in workers]
    assert (await fan("clear_kv_cache", clear, None, DEADLINE)).keys() == {1, 2}
    assert [w.requests[1].id for w in workers] == [i + 1 for i in ids]  # each link numbers its own requests


async def test_an_in_step_refusal_fails_the_operation_but_keeps_the_group(rank0: Rank0Thread) -> None:
    def refuse_once(request: rpc.Request) -> rpc.Reply:
        if request.id > 1:
            return cleared(request)
        return rpc.Error(id=request.id, kind=ErrorKind.BAD_STATE, message="rank 2: desync: sequence 7 unknown")

    fan, _ = fan_out(rank0, cleared, refuse_once)
    with pytest.raises(PoolError) as caught:
        await fan("generate_step", clear, rank0_ok, DEADLINE)
    assert not caught.value.broken and fan.broken is None
    assert caught.value.failures == {2: "bad_state: desync: sequence 7 unknown"}
    assert "rank 2 on mac3: bad_state: desync" in str(caught.value)
    assert (await fan("clear_kv_cache", clear, rank0_ok, DEADLINE))[0] == "rank 0 done"  # still in step


async def test_a_failed_collective_breaks_the_group_for_good(rank0: Rank0Thread) -> None:
    def collective(request: rpc.Request) -> rpc.Reply:
        return rpc.Error(id=request.id, kind=ErrorKind.GROUP_FAILED, message="rank 1: all_sum failed")

    fan, workers = fan_out(rank0, collective, cleared)
    with pytest.raises(PoolError) as caught:
        await fan("generate_step", clear, rank0_ok, DEADLINE)
    assert caught.value.broken and fan.broken is caught.value
    with pytest.raises(PoolError) as again:
        await fan("clear_kv_cache", clear, rank0_ok, DEADLINE)
    assert again.value is caught.value and [len(w.requests) for w in workers] == [1, 1]  # nothing sent once broken


async def test_rank0s_own_errors_break_the_group_unless_raised_in_step(rank0: Rank0Thread) -> None:
    def refused(rank: Any) -> None:
        raise RankError("rank 0: no model loaded; send load_share first")

    def crashed(rank: Any) -> None:
        raise MemoryError("out of memory")

    fan, _ = fan_out(rank0, cleared, cleared)
    with pytest.raises(PoolError) as caught:
        await fan("generate_step", clear, refused, DEADLINE)
    assert not caught.value.broken and "rank 0 on leader: RankError: rank 0: no model" in str(caught.value)
    with pytest.raises(PoolError) as caught:
        await fan("generate_step", clear, crashed, DEADLINE)
    assert caught.value.broken and caught.value.failures == {0: "MemoryError: out of memory"}


async def test_a_worker_that_cannot_be_sent_to_skips_rank0_and_the_others_are_still_drained(
    rank0: Rank0Thread,
) -> None:
    ran: list[bool] = []
    fan, workers = fan_out(rank0, cleared, cleared)
    workers[0].returncode = -9  # killed before the step
    with pytest.raises(PoolError) as caught:
        await fan("generate_step", clear, lambda rank: ran.append(True), DEADLINE)
    assert caught.value.broken and ran == []  # its collectives would wait for rank 1 forever
    # Nothing says who sent the SIGKILL (its host's OOM count unread): nobody is blamed.
    killed = (
        "was killed by SIGKILL (its host's OOM count could not be read: "
        "whether the kernel's OOM killer sent it is unknown)"
    )
    assert caught.value.failures == {1: f"worker pid 4001 {killed} during generate_step"}
    assert len(workers[1].requests) == 1 and workers[1].stdout.statistics().current_buffer_used == 0  # drained


async def test_a_worker_lost_mid_step_abandons_rank0s_wait(rank0: Rank0Thread) -> None:
    """Rank 0 may sit inside a collective for the dead peer forever: the fan-out stops waiting for it."""
    release = anyio.Event()
    fan, _ = fan_out(rank0, lambda request: 1, cleared)
    token = anyio.lowlevel.current_token()  # rank 0's thread is not one of anyio's: it must be told the loop

    def stuck_in_a_collective(rank: Any) -> None:
        anyio.from_thread.run(release.wait, token=token)

    with anyio.fail_after(DEADLINE), pytest.raises(PoolError) as caught:
        await fan("generate_step", clear, stuck_in_a_collective, 60.0)
    release.set()
    assert caught.value.broken
    assert caught.value.failures[1] == "worker pid 4001 exited with code 1 during generate_step"
    assert caught.value.failures[0].startswith("abandoned: a peer failed")


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (lambda request: None, "no reply to generate_step within the deadline (pid 4001 alive but stuck?)"),
        (lambda request: rpc.Bye(id=request.id), "bye does not answer clear_kv_cache"),
        (lambda request: rpc.KvCacheCleared(id=request.id + 1), "does not answer request id"),
        (lambda request: b"not json\n", "protocol violation during generate_step"),
    ],
    ids=["silent", "wrong reply", "wrong id", "garbage"],
)
async def test_a_worker_that_does_not_answer_properly_breaks_the_group_naming_it(
    rank0: Rank0Thread, answer: Answer, says: str
) -> None:
    fan, _ = fan_out(rank0, answer, cleared)
    with pytest.raises(PoolError) as caught:
        await fan("generate_step", clear, rank0_ok, 0.5)
    assert caught.value.broken and says in caught.value.failures[1], caught.value.failures


async def test_rank0s_job_is_queued_before_the_event_loop_runs_anything_else(rank0: Rank0Thread) -> None:
    """Rank 0 starts its part at once: the streams of the step before, which are ready on the event loop, run
    beside it and never in front of it."""
    queued: list[object] = []
    jobs = rank0._jobs
    put = jobs.put

    class Watched:
        def put(self, job: object) -> None:
            queued.append(job)
            put(job)  # type: ignore[arg-type]

        def get(self) -> object:
            return jobs.get()

    rank0._jobs = Watched()  # type: ignore[assignment]
    seen: list[int] = []
    fan, _ = fan_out(rank0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: _note(seen, queued))  # ready now: it runs at the caller's first yield
        assert await fan("generate_step", clear, rank0_ok, DEADLINE) == {0: "rank 0 done"}
    assert seen == [1]


async def _note(seen: list[int], queued: list[object]) -> None:
    seen.append(len(queued))


async def test_rank0_stuck_past_the_deadline_breaks_the_group(rank0: Rank0Thread) -> None:
    release = threading.Event()
    fan, _ = fan_out(rank0)
    with anyio.fail_after(DEADLINE), pytest.raises(PoolError) as caught:
        await fan("generate_step", clear, lambda rank: release.wait(DEADLINE), 0.2)
    release.set()
    assert caught.value.broken and "rank 0 is stuck" in caught.value.failures[0], caught.value.failures
