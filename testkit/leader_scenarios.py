"""Leader-side scenarios, each run in a fresh process by the tests.

A process can host rank 0 of one mx.distributed group only (an MLX limit), so
every multi-rank pool a test needs gets a process of its own. Run as
``python -m testkit.leader_scenarios NAME JSON_ARGS`` from the repository's root (testkit/scenarios.py does); the
result is one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from neuron import log
from neuron.cli.main import leave_if_rank0_is_busy
from neuron.models.folder import ModelError
from neuron.pool import Deadlines, Layout, Pool, PoolError
from neuron.rpc import Decode, Prefill, StepPlan
from neuron.sampling_params import SamplingParams
from neuron.step import Start, Step
from testkit import faults

PROMPT = [5, 17, 99, 42, 7, 120, 64, 3, 88]


def start(prompt: list[int]) -> Step:
    """Sequence number 1's whole prompt in one step, sampled greedily."""
    return Step(StepPlan(prefill=[Prefill(1, 0, prompt, True)]), {1: Start(SamplingParams())})


def follow(token: int) -> Step:
    """Sequence number 1 decodes ``token``."""
    return Step(StepPlan(decode=[Decode(1, token, 0)]))


async def greedy(pool: Pool, prompt: list[int], count: int) -> list[int]:
    """One sequence (number 1): its prompt, then one token per step."""
    await pool.clear_kv_cache()
    tokens = [(await pool.step(start(prompt)))[1].token]
    while len(tokens) < count:
        tokens.append((await pool.step(follow(tokens[-1])))[1].token)
    return tokens


async def greedy_timed(pool: Pool, prompt: list[int], count: int) -> list[float]:
    """Like ``greedy``; returns each decode step's seconds."""
    await pool.clear_kv_cache()
    token = (await pool.step(start(prompt)))[1].token
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        token = (await pool.step(follow(token)))[1].token
        seconds.append(time.perf_counter() - started)
    return seconds


async def spawn(model: str, world_size: int) -> dict[str, Any]:
    """Spawn and join, then ask for a step before any load: it is refused, and the pool still answers."""
    async with Pool(model, Layout.local(world_size)) as pool:
        pids = [w.pid for w in pool.workers]
        try:
            await pool.step(start([1, 2]))
            step_error = ""
        except PoolError as e:
            step_error = f"broken={e.broken}: {e}"
        await pool.clear_kv_cache()
    return {"pids": pids, "step_error": step_error}


async def generate(
    model: str, world_size: int, count: int, stages: int = 1, split: list[int] | None = None
) -> dict[str, Any]:
    """Generate, then load again (a rank frees its model first) and generate again; in ``stages`` pipeline stages
    when more than one."""
    async with Pool(model, Layout.local(world_size, stages, tuple(split or ()))) as pool:
        loaded = await pool.load()
        tokens = await greedy(pool, PROMPT, count)
        read_unasked = dict(pool.memory)  # no step asked every rank to read its memory
        await pool.step(follow(tokens[-1]), read_memory=True)
        read = {rank: {"used": m.used, "free": m.free, "caches": m.caches} for rank, m in pool.memory.items()}
        await pool.load()
        return {
            "tokens": tokens,
            "after_reload": await greedy(pool, PROMPT, count),
            "parameters": [loaded[r].parameters for r in loaded],
            "layers": pool.layers,
            "read_unasked": list(read_unasked),
            "read": read,
        }


async def fail_then_recover(model: str, count: int) -> dict[str, Any]:
    """Generate with a fault injected (``testkit.faults``, by the environment); then clear and generate again."""
    async with Pool(model, Layout.local(2)) as pool:
        await pool.load()
        try:
            await greedy(pool, PROMPT, count)
            failure: dict[str, Any] = {}
        except PoolError as e:
            failure = {"failures": {str(r): m for r, m in e.failures.items()}, "broken": e.broken, "message": str(e)}
        await pool.clear_kv_cache()
        return {"failure": failure, "after": await greedy(pool, PROMPT, count)}


async def desyncs(model: str, count: int) -> dict[str, Any]:
    """Two plans a rank cannot follow, one after the other on one pool (each ends with the group in step, as its
    own "after" shows): ``impossible_plan``, then ``one_rank_disagrees``. The step deadline is 30 s, so that a
    rank left waiting would show in the second's seconds."""
    async with Pool(model, Layout.local(2), Deadlines(step=30)) as pool:
        await pool.load()
        return {"impossible": await impossible_plan(pool, count), "disagrees": await one_rank_disagrees(pool, count)}


async def impossible_plan(pool: Pool, count: int) -> dict[str, Any]:
    """A plan no rank can follow (a sequence nobody holds): every rank still runs the step's
    collectives on throwaway caches, so the group stays in step, and says so."""
    await pool.clear_kv_cache()
    try:
        await pool.step(Step(StepPlan(decode=[Decode(42, 7, 0), Decode(43, 8, 0)])))
        failure = {}
    except PoolError as e:
        failure = {"failures": {str(r): m for r, m in e.failures.items()}, "broken": e.broken}
    await pool.clear_kv_cache()
    return {"failure": failure, "after": await greedy(pool, PROMPT, count)}


async def one_rank_disagrees(pool: Pool, count: int) -> dict[str, Any]:
    """Rank 0 alone forgets a sequence: it must still run the step's collectives (on throwaway caches),
    or rank 1 would wait inside them until the deadline."""
    await pool.clear_kv_cache()
    first = (await pool.step(start(PROMPT)))[1]
    await pool._ranks.rank0.call(lambda rank: rank.held.seqs.pop(1), 30)
    started = time.monotonic()
    try:
        await pool.step(follow(first.token))
        failure = {}
    except PoolError as e:
        failure = {"failures": {str(r): m for r, m in e.failures.items()}, "broken": e.broken}
    seconds = time.monotonic() - started
    await pool.clear_kv_cache()
    return {"failure": failure, "seconds": seconds, "after": await greedy(pool, PROMPT, count)}


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def kill_mid_step(model: str) -> dict[str, Any]:
    async with Pool(model, Layout.local(2)) as pool:
        await pool.load()
        victim = pool.workers[0]
        outcome: dict[str, Any] = {}

        async def long_step() -> None:
            try:
                await pool.step(start(list(range(3, 200)) * 10))
            except PoolError as e:
                outcome["failures"] = {str(r): m for r, m in e.failures.items()}
                outcome["broken"] = e.broken
            outcome["ended"] = time.monotonic()

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_step)
            before = _cpu_ticks(victim.pid)
            # Kill it once it is busy with the step, not before the request reached it.
            deadline = time.monotonic() + 30
            while _cpu_ticks(victim.pid) < before + 5 and time.monotonic() < deadline:
                await anyio.sleep(0.005)
            outcome["ended_before_kill"] = "ended" in outcome
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
        outcome["seconds_to_error"] = outcome.pop("ended") - killed
        try:
            await pool.clear_kv_cache()
            outcome["refused_after"] = False
        except PoolError as e:
            outcome["refused_after"] = e.broken
        return outcome


async def unsplittable(model: str, world_size: int) -> dict[str, Any]:
    """The model is refused before a single worker is spawned."""
    pool = Pool(model, Layout.local(world_size))
    started = time.monotonic()
    try:
        async with pool:
            error = ""
    except ModelError as e:
        error = str(e)
    return {"error": error, "spawned": len(pool.workers), "seconds": time.monotonic() - started}


async def adapters(
    model: str, world_size: int, stages: int, paths: dict[str, str], bad: dict[str, str], count: int
) -> dict[str, Any]:
    """LoRA adapters (``paths``: name -> folder, numbered 1.. in order) on every rank: each one's greedy tokens alone,
    then every adapter and the base (0) as rows of one batch, each prompt fed in one step with the others'; then the
    model loaded again (the adapters with it) and the first adapter alone again; and why each of ``bad`` is
    refused."""
    async with Pool(model, Layout.local(world_size, stages)) as pool:
        await pool.load()
        numbers = list(range(len(paths) + 1))
        projections = {}
        for number, (name, path) in enumerate(paths.items(), start=1):
            projections[name] = await pool.load_adapter(number, name, path)
        alone = {n: await adapted(pool, PROMPT, count, n) for n in numbers}
        together = await batched(pool, PROMPT, count, numbers)
        await pool.load()
        reloaded = await adapted(pool, PROMPT, count, 1)
        refused = {}
        for number, (name, path) in enumerate(bad.items(), start=len(paths) + 1):
            try:
                await pool.load_adapter(number, name, path)
                refused[name] = ""
            except PoolError as e:
                refused[name] = str(e)
        after_refusals = await adapted(pool, PROMPT, count, 1)
        return {
            "projections": projections,
            "layers": pool.layers,
            "alone": alone,
            "together": together,
            "reloaded": reloaded,
            "refused": refused,
            "after_refusals": after_refusals,
        }


async def adapted(pool: Pool, prompt: list[int], count: int, adapter: int) -> list[int]:
    """``greedy``, with LoRA adapter ``adapter`` (0: the base model)."""
    await pool.clear_kv_cache()
    plan = StepPlan(prefill=[Prefill(1, 0, prompt, True, adapter=adapter)])
    tokens = [(await pool.step(Step(plan, {1: Start(SamplingParams())})))[1].token]
    while len(tokens) < count:
        tokens.append((await pool.step(Step(StepPlan(decode=[Decode(1, tokens[-1], 0, adapter=adapter)]))))[1].token)
    return tokens


async def batched(pool: Pool, prompt: list[int], count: int, adapters: list[int]) -> dict[int, list[int]]:
    """One sequence per adapter in ``adapters``, numbered as they are, fed together and decoded as one batch."""
    await pool.clear_kv_cache()
    plan = StepPlan(prefill=[Prefill(n + 1, 0, prompt, True, adapter=n) for n in adapters])
    sampled = await pool.step(Step(plan, {n + 1: Start(SamplingParams()) for n in adapters}))
    tokens = {n: [sampled[n + 1].token] for n in adapters}
    while len(tokens[adapters[0]]) < count:
        rows = [Decode(n + 1, tokens[n][-1], 0, adapter=n) for n in adapters]
        sampled = await pool.step(Step(StepPlan(decode=rows)))
        for n in adapters:
            tokens[n].append(sampled[n + 1].token)
    return tokens


async def hold(model: str, world_size: int) -> None:
    """Print the worker pids, then wait on stdin until killed."""
    async with Pool(model, Layout.local(world_size)) as pool:
        print(json.dumps({"pids": [w.pid for w in pool.workers]}), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)


SCENARIOS = {
    f.__name__: f
    for f in (
        spawn,
        generate,
        fail_then_recover,
        desyncs,
        kill_mid_step,
        unsplittable,
        adapters,
        hold,
    )
}

if __name__ == "__main__":
    faults.install()  # the faults the test names in the environment, if any, on every rank
    log.configure("info", "json")  # on stderr: stdout carries the result
    name, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else []
    result = anyio.run(SCENARIOS[name], *args)
    print(json.dumps(result), flush=True)
    leave_if_rank0_is_busy(0)  # as neuron's own command does
