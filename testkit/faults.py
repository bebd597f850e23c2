"""Faults injected into real ranks, for the tests: an entry point in front of ``neuron``, never in production code.

``python -m testkit.faults serve ...`` (or ``--worker ...``) runs neuron with every rank, rank 0 in the leader and
each worker, a ``FaultyRank``; the processes it starts (workers, a leader re-executing itself) run this entry point
too (``neuron.system.reexec.MODULE``). A script that drives a pool itself calls ``install()`` first. The faults are read
from the environment, which every process of the group inherits:

``NEURON_TEST_FAIL_STEP`` makes a rank fail after given steps, with every collective of the step done, as a bug in
post-processing would. ``NEURON_TEST_OUT_OF_MEMORY`` names a path: once ``PATH.R`` exists (a test creates it),
rank R fails to allocate in its next step, after its forward, with MLX's own words, as MLX out of memory on Metal
or CUDA does (on the CPU, Linux's overcommit kills the process before any allocation fails), and removes the file.
``NEURON_TEST_DESYNC_STEP`` makes a rank silently record a wrong token for a sequence after
given steps, so that its state digest differs from its peers'. ``NEURON_TEST_DROP_ENTRY`` makes a rank lose a
prefix-cache entry after given steps, as a rank whose cache went its own way would. All read
``RANK:STEP[,STEP...]``, several ranks joined by ``;`` (``0:50;1:20,80``); a rank counts the steps it is sent since
its model loaded. ``NEURON_TEST_CRASH_ON`` makes a rank's process die (SIGKILL, as a crash inside MLX would)
whenever a step feeds it given tokens in a row, ``RANK:TOKEN,TOKEN...`` (``1:17,4,99``): a request whose prompt
kills its rank every time. ``NEURON_TEST_WEDGE`` names a path: once ``PATH.0`` and ``PATH.1`` exist (a test creates
both), rank 1 dies (SIGKILL) at its next step, with its connections' holder (``launch.holder``), and rank 0 at its
next step has a collective fail on the loss, then queues another, as a step run ahead does, and waits on it after its
step: where the ring's socket thread for it has ended, it waits forever, whatever is cut (``Pool.recover``); each
rank removes its file, so that the fault fires once. ``NEURON_TEST_FAKE_HOST`` makes a host say other things of
itself in its handshake: ``mlx=0.0.1`` on every rank, or per rank,
``1:free_memory=2000000000;2:free_memory=1000000000`` or ``gpus=1``, to see the leader refuse it or split by it.
``NEURON_TEST_SLOW_JOIN`` (``RANK:SECONDS``) makes a rank wait that long before it joins the group, so that its
peers sit inside ``mx.distributed.init`` meanwhile. ``NEURON_TEST_SLOW_PUSH`` makes a host receiving a share of the
model (``--push-model``) take that many seconds over each 64 KiB chunk, as a slow link would, so that a test can cut
the push midway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

FAIL_ENV = "NEURON_TEST_FAIL_STEP"
OOM_ENV = "NEURON_TEST_OUT_OF_MEMORY"
DESYNC_ENV = "NEURON_TEST_DESYNC_STEP"
DROP_ENTRY_ENV = "NEURON_TEST_DROP_ENTRY"
FAKE_HOST_ENV = "NEURON_TEST_FAKE_HOST"
SLOW_PUSH_ENV = "NEURON_TEST_SLOW_PUSH"
CRASH_ENV = "NEURON_TEST_CRASH_ON"
WEDGE_ENV = "NEURON_TEST_WEDGE"
SLOW_JOIN_ENV = "NEURON_TEST_SLOW_JOIN"
ENTRY = "testkit.faults"  # what ``python -m`` runs
ROOT = Path(__file__).resolve().parent.parent


def steps(env: str, rank: int) -> frozenset[int]:
    """The steps after which ``rank`` is to fail (or desync, or drop an entry), from ``env``."""
    found: set[int] = set()
    for spec in filter(None, os.environ.get(env, "").split(";")):
        listed_rank, _, listed = spec.partition(":")
        if int(listed_rank) == rank:
            found.update(int(step) for step in listed.split(","))
    return frozenset(found)


def crash_tokens(rank: int) -> list[int]:
    """The tokens whose feeding kills ``rank``, from ``NEURON_TEST_CRASH_ON`` (empty: none)."""
    for spec in filter(None, os.environ.get(CRASH_ENV, "").split(";")):
        listed_rank, _, listed = spec.partition(":")
        if int(listed_rank) == rank:
            return [int(token) for token in listed.split(",")]
    return []


def feeds(tokens: list[int], run: list[int]) -> bool:
    """Whether ``run`` occurs in ``tokens``, in a row."""
    return bool(run) and any(tokens[i : i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


def fake_host(info: Any, rank: int) -> Any:
    """``info`` (a ``HostInfo``) with what ``NEURON_TEST_FAKE_HOST`` makes ``rank`` say instead."""
    for spec in filter(None, os.environ.get(FAKE_HOST_ENV, "").split(";")):
        target, _, assignments = spec.rpartition(":")
        if target and int(target) != rank:
            continue
        fields: dict[str, Any] = dict(part.partition("=")[::2] for part in assignments.split(","))
        for number in ("free_memory", "gpus", "memory_limit", "oom_kills"):
            if number in fields:
                fields[number] = int(fields[number])
        info = dataclasses.replace(info, **fields)
    return info


def install() -> None:
    """Make this process's ranks ``FaultyRank``s and its hosts say what the environment fakes, and have every
    process it starts run this entry point. Nothing is imported here: a worker loads MLX (with ``neuron.rank.rank``)
    only once it is pinned to its cores, so each module is patched as it is imported."""
    start_here()
    when_imported("neuron.rank.rank", _faulty_ranks)
    for name in ("neuron.pool.ranks", "neuron.cli.worker"):  # the two that ask a host to describe itself
        when_imported(name, lambda module: setattr(module, "describe_host", _describe_host))
    if delay := float(os.environ.get(SLOW_PUSH_ENV) or 0):
        when_imported("neuron.launch.push", lambda module: _slow_push(module, delay))


def start_here() -> None:
    """Have every process this one starts (a worker, this one re-executed) run this entry point, wherever its
    working directory."""
    from neuron.system import reexec

    reexec.MODULE = ENTRY
    if str(ROOT) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call ``then(module)`` once module ``name`` is imported, by whoever imports it first (now, if it is)."""
    if name in sys.modules:
        then(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            assert spec is not None and spec.loader is not None
            spec.loader = _Then(spec.loader, then)
            return spec

    sys.meta_path.insert(0, Finder())


class _Then(importlib.abc.Loader):
    """A module's own loader, and ``then`` called on the module once it has run."""

    def __init__(self, inner: importlib.abc.Loader, then: Callable[[ModuleType], None]) -> None:
        self.inner = inner
        self.then = then

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.then(module)


def _describe_host(number: int) -> Any:
    from neuron.launch import hosts

    return fake_host(hosts.describe_host(number), number)


def _slow_push(push: ModuleType, delay: float) -> None:
    """A receiving host that writes 64 KiB chunks, each ``delay`` seconds late."""
    write = push.write_chunk

    def slow(weights: Any, chunk: bytes) -> None:
        time.sleep(delay)
        write(weights, chunk)

    push.CHUNK = 64 * 1024  # type: ignore[attr-defined]
    push.write_chunk = slow  # type: ignore[attr-defined]


def _faulty_ranks(rank: ModuleType) -> None:
    """``neuron.rank.rank``'s ``Rank`` replaced by one that fails, desyncs or loses an entry after the steps the
    environment names (rank 0 is made by the leader's rank-0 thread, a worker's rank by the worker)."""
    from neuron.rpc import Evict, StepPlan

    class FaultyRank(rank.Rank):  # type: ignore[name-defined]
        def __init__(self, number: int, world_size: int, cores: list[int] | None = None) -> None:
            super().__init__(number, world_size, cores)
            self.steps_sent = 0  # since the model loaded

        def init_group(self, backend: str, env: dict[str, str], files: dict[str, str]) -> float:
            for spec in filter(None, os.environ.get(SLOW_JOIN_ENV, "").split(";")):
                listed_rank, _, seconds = spec.partition(":")
                if int(listed_rank) == self.rank:
                    time.sleep(float(seconds))
            return super().init_group(backend, env, files)

        def load(self, model_path: str, layers: list[int], kv_bits: int | None = None) -> Any:
            self.steps_sent = 0
            return super().load(model_path, layers, kv_bits)

        def step(self, plan: StepPlan, pixels: Any = None) -> Any:
            self.steps_sent += 1
            if (run := crash_tokens(self.rank)) and any(feeds(chunk.tokens, run) for chunk in plan.prefill):
                os.kill(os.getpid(), signal.SIGKILL)
            wedged = _wedge(self)
            try:
                out = super().step(plan, pixels)
            finally:
                if wedged is not None:
                    import mlx.core as mx

                    mx.eval(wedged)  # never returns: see WEDGE_ENV
            if self.steps_sent in steps(DESYNC_ENV, self.rank) and self.held.seqs:
                self.held.seqs[min(self.held.seqs)].last += 1
            if self.steps_sent in steps(DROP_ENTRY_ENV, self.rank) and (held := list(self.held.entries)):
                self.held.entries.evict_and_save(StepPlan(evict=[Evict(held[0])]), {})
            if self.steps_sent in steps(FAIL_ENV, self.rank):
                raise rank.RankError(f"rank {self.rank}: injected failure after step {self.steps_sent} ({FAIL_ENV})")
            if (path := os.environ.get(OOM_ENV)) and Path(f"{path}.{self.rank}").exists():
                Path(f"{path}.{self.rank}").unlink()
                raise RuntimeError("[malloc] Unable to allocate 1073741824 bytes.")  # MLX's allocators' words
            return out

    rank.Rank = FaultyRank  # type: ignore[attr-defined]
    if (rank0 := sys.modules.get("neuron.pool.rank0")) is not None:  # imported it before this ran
        rank0.Rank = FaultyRank  # type: ignore[attr-defined]


def _wedge(rank: Any) -> Any:
    """``WEDGE_ENV``'s fault on ``rank`` once its file is there: rank 1 dies half a second into its step; rank 0
    queues collectives its peer never joins, waits for the peer's loss to fail the first, and returns the last,
    for its step to wait on; None otherwise."""
    path = os.environ.get(WEDGE_ENV)
    if not path or rank.rank > 1 or not Path(f"{path}.{rank.rank}").exists():
        return None
    Path(f"{path}.{rank.rank}").unlink()
    if rank.rank == 1:
        time.sleep(0.5)
        from neuron.launch import holder

        for held in holder._keep.values():  # the connections close at once, as when a host's every process dies
            held.kill()
            held.wait(5)  # gone before this process is: else its copies answer for it a moment
        os.kill(os.getpid(), signal.SIGKILL)
    import mlx.core as mx

    ones = mx.ones((1024,))
    first = mx.distributed.all_sum(ones * 2, group=rank.group)
    mx.async_eval(first)
    time.sleep(1.5)
    with contextlib.suppress(RuntimeError):  # the peer is gone: the ring's socket threads fail it and end
        mx.eval(first)
    last = mx.distributed.all_sum(ones * 3, group=rank.group)  # queued after them, as a step run ahead is
    mx.async_eval(last)
    return last


def main() -> int:
    from neuron.cli.main import main as neuron_main

    install()
    return neuron_main()


if __name__ == "__main__":
    sys.exit(main())
