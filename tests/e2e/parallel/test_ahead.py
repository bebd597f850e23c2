"""Rank 0 runs the next decode step ahead of its plan: the device never waits for the host in steady decode.

A real tiny model on one rank, in this process (no worker, no HTTP): steps are driven through ``rank.rank.run``,
the function every rank runs (rank 0's thread with its head). What is checked: a steady decode step reads the
device once, in ``sampler.read``, and nowhere else (a stray ``.item()`` or ``.tolist()`` fails it); the tokens are
those of the same steps run without running ahead, across a join, a leave and a sequence that finishes; and a plan that
differs from the step run ahead undoes it.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from neuron.rank import readback
from neuron.rank.ahead import EVALUATES_ASYNC
from neuron.rank.head import sampler
from neuron.rank.head.head import Head
from neuron.rank.model.load import dispatch_layers
from neuron.rank.rank import Rank, run
from neuron.rpc import Decode, Prefill, StepPlan
from neuron.sampling_params import SamplingParams
from neuron.step import Sampled, Start, Step
from neuron.system import cpu

pytestmark = pytest.mark.gpu  # where the device computes apart from the host: bench/gpu_table.py runs them there

PROMPTS = {1: [5, 17, 99, 42, 7, 120], 2: [8, 3, 77, 64], 3: [33, 34, 35]}


@contextmanager
def host_reads() -> Iterator[Counter[tuple[str, str]]]:
    """Every call that brings MLX arrays to the host (evaluations and reads), by (call, calling function); the
    sampler's typed readers are seen through, to the function that called them."""
    calls: Counter[tuple[str, str]] = Counter()
    readers = {reader.__code__ for reader in (readback.ints, readback.floats, readback.scalar, sampler._on_host)}
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            while caller.f_code in readers and caller.f_back is not None:
                caller = caller.f_back
            calls[(name, caller.f_code.co_name)] += 1
            return original(*args, **kwargs)

        patched.append((owner, name, original))
        setattr(owner, name, counted)

    wrap(mx, "eval")
    for name in ("item", "tolist", "__array__", "__int__", "__float__", "__bool__", "__index__"):
        wrap(mx.array, name)
    try:
        yield calls
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)


@pytest.fixture(scope="module")
def rank(tiny_models: dict[str, Path]) -> Rank:
    rank = Rank(0, 1)
    rank.load(str(tiny_models["qwen3"]), [])
    return rank


class Driver:
    """Runs steps as the engine would, deciding ``ahead`` as the scheduler does for a steady batch."""

    def __init__(self, rank: Rank, ahead: bool) -> None:
        rank.clear_kv_cache()
        self.rank, self.head, self.ahead = rank, Head(), ahead
        self.next: dict[int, int] = {}  # each decoding sequence's next token

    def step(self, plan: StepPlan, starts: dict[int, Start] | None = None) -> dict[int, Sampled]:
        sampled = self.lead(plan, starts)
        self.rank.ahead.settle(wait=False)  # as rank 0's thread does once the reply is on its way
        return sampled

    def lead(self, plan: StepPlan, starts: dict[int, Start] | None = None) -> dict[int, Sampled]:
        """The step up to its reply: what the leader waits for."""
        sampled = run(self.rank, Step(plan, starts or {}), self.head).sampled
        for seq in plan.leave:
            self.next.pop(seq, None)
        self.next.update({seq: one.token for seq, one in sampled.items()})
        return sampled

    def start(
        self, *seqs: int, params: Callable[[int], SamplingParams] = lambda _: SamplingParams()
    ) -> dict[int, Sampled]:
        chunks = [Prefill(seq, 0, PROMPTS[seq], True) for seq in seqs]
        rows = [Decode(seq, token, 0) for seq, token in self.next.items()]  # the batch decodes meanwhile
        return self.step(StepPlan(prefill=chunks, decode=rows), {seq: Start(params(seq)) for seq in seqs})

    def decode(self, leave: tuple[int, ...] = (), steady: bool = True) -> dict[int, Sampled]:
        for seq in leave:
            self.next.pop(seq)
        rows = [Decode(seq, token, 0) for seq, token in self.next.items()]
        return self.step(StepPlan(leave=list(leave), decode=rows, ahead=self.ahead and steady))


def scenario(rank: Rank, ahead: bool) -> list[dict[int, int]]:
    """Two sequences, a third joining, one leaving, one sampled with a seed and penalties."""
    seeded = {2: SamplingParams(temperature=0.8, seed=7, repetition_penalty=1.3, logprobs=2)}
    driver = Driver(rank, ahead)
    driver.start(1, 2, params=lambda seq: seeded.get(seq, SamplingParams()))
    out = [{s: one.token for s, one in driver.decode().items()} for _ in range(4)]
    out.append({s: one.token for s, one in driver.decode(steady=False).items()})  # a join comes next
    out.append({s: one.token for s, one in driver.start(3).items()})
    out += [{s: one.token for s, one in driver.decode().items()} for _ in range(3)]
    out.append({s: one.token for s, one in driver.decode(leave=(1,)).items()})  # 1 leaves the step run ahead
    out += [{s: one.token for s, one in driver.decode().items()} for _ in range(3)]
    return out


def test_running_ahead_gives_the_tokens_of_running_in_step(rank: Rank) -> None:
    assert scenario(rank, ahead=True) == scenario(rank, ahead=False)


def test_a_steady_decode_step_reads_the_device_once(rank: Rank) -> None:
    driver = Driver(rank, ahead=True)
    driver.start(1, 2, params=lambda seq: SamplingParams(temperature=0.7, seed=seq))
    for _ in range(3):
        driver.decode()
    rows = [Decode(seq, token, 0) for seq, token in driver.next.items()]
    with host_reads() as calls:
        driver.lead(StepPlan(decode=rows, ahead=True))
    outside = {call: n for call, n in calls.items() if call[1] != "read"}
    assert outside == {}, f"host reads outside sampler.read in a steady step: {outside}"
    assert calls[("eval", "read")] == 1
    assert rank.ahead.queued is not None  # the next step is queued
    if not EVALUATES_ASYNC:  # the CPU computes it after the reply, not before, and rank 0's thread waits for none
        with host_reads() as calls:
            rank.ahead.settle(wait=False)
        assert calls == {}


def test_a_step_with_drafts_reads_the_device_once(rank: Rank) -> None:
    """Drafted rows (greedy, and seeded with a penalty) are verified in the step's one read, beside a plain row."""
    driver = Driver(rank, ahead=False)
    seeded = SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.2)
    driver.start(1, 2, 3, params=lambda seq: seeded if seq == 2 else SamplingParams())
    driver.decode()
    rows = [Decode(seq, token, 0, [7, 8] if seq != 3 else []) for seq, token in driver.next.items()]
    with host_reads() as calls:
        sampled = driver.lead(StepPlan(decode=rows))
    assert {call for call in calls if call[0] == "eval"} == {("eval", "read")}
    assert calls[("eval", "read")] == 1
    assert set(sampled) == {1, 2, 3} and not sampled[3].more


def test_a_plan_that_is_not_the_step_run_ahead_undoes_it(rank: Rank) -> None:
    def run(ahead: bool) -> tuple[int, list[int]]:
        driver = Driver(rank, ahead)
        driver.start(1)
        driver.decode()  # with ahead, the next step is now queued: its token is in the cache already
        before = rank.held.batch.micro_batches[0].cache[0].offset.tolist()
        # The next plan feeds a token the rank did not draw: the step run ahead must go.
        token = driver.step(StepPlan(decode=[Decode(1, driver.next[1] + 1, 0)]))[1].token
        after = rank.held.batch.micro_batches[0].cache[0].offset.tolist()
        return token, [a - b for a, b in zip(after, before, strict=True)]

    assert run(ahead=True) == (run(ahead=False)[0], [0])  # the queued token undone, the plan's fed in its place


@pytest.mark.skipif(not cpu.is_linux_cpu_backend(), reason="a rank alone on the Linux CPU dispatches layers early")
def test_a_rank_alone_on_the_cpu_hands_each_layer_to_the_stream_as_it_is_built(rank: Rank) -> None:
    """MLX's CPU ``eval`` holds its caller back once ten tasks are queued, so a graph built whole is built while the
    stream waits: each decoder layer is queued (``mx.async_eval``) as soon as it is built, with the same answers
    (the tokens of ``test_running_ahead_gives_the_tokens_of_running_in_step`` are those of a rank that does)."""
    assert rank.model is not None
    layers = list(rank.model.layers)
    assert all(getattr(type(layer), "dispatches", False) for layer in layers)
    queued: list[object] = []
    original = mx.async_eval

    def counted(*args: Any) -> None:
        queued.append(args)
        original(*args)

    mx.async_eval = counted
    try:
        tokens = mx.array([[5, 17, 99]])
        mx.eval(rank.model(tokens))
    finally:
        mx.async_eval = original
    assert len(queued) == len(layers)
    classes = [type(layer) for layer in layers]
    dispatch_layers(rank.model)  # again: no layer is wrapped twice
    assert [type(layer) for layer in rank.model.layers] == classes
