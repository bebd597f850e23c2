"""Rank 0's thread: the one thread that runs rank 0's MLX work, for the life of the pool.

Why one dedicated thread: MLX streams belong to the thread that created them,
so rank 0's group, weights, KV caches and head must all be made and used
on one thread. A job handed to that thread is shielded from cancellation: once
the workers have a step, rank 0 must do its part of the collectives too, or
the workers wait inside them forever.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio

from neuron.rank.dist import backends
from neuron.rank.head.head import Head
from neuron.rank.rank import Rank
from neuron.system import cpu

T = TypeVar("T")


class Abandoned(RuntimeError):
    """The leader stopped waiting for rank 0 because a peer it depends on failed."""


class Rank0Thread:
    """Runs jobs on rank 0's ``Rank`` and ``Head``, one at a time, on a thread of its own."""

    def __init__(self, world_size: int, cpus: list[int] | None) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._cpus = cpus
        self._world_size = world_size
        self._caller = threading.get_native_id()  # the event loop's thread, which starts this one
        self._core: list[int] | None = None  # the one core this thread runs on, where others are left to the loop
        self._cores: list[int] = []  # every core the rank may use, over which it spreads where steps are long
        self._placed: list[int] = []  # this thread and the stream thread MLX started beside it, by native id
        self._spread = False  # whether they float over ``_cores`` now (``place``)
        self._loop_cores: set[int] | None = None  # the event loop's cores while it is kept off ``_core``
        self._abandoned = threading.Event()  # left behind, wedged: it must run nothing more when it comes out
        self.rank: Rank | None = None
        self._start_error: Exception | None = None  # why ``Rank`` could not be made, where it could not
        self.head = Head()  # touched only by jobs, on this thread
        # A daemon: if rank 0 is wedged inside a collective (a peer that never
        # answers), nothing can interrupt it, and it must not keep the process alive.
        self._thread = threading.Thread(target=self._run, name="neuron-rank0", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cores = self._cpus or cpu.allowed_cores()  # before one_core takes this thread to one of them
        if self._cpus:
            cpu.pin(self._cpus)
            cpu.set_blas_threads(len(self._cpus))
        elif self._world_size == 1 and cpu.is_linux_cpu_backend():
            core = cpu.one_core()
            if len(cores) > 1:
                self._core, self._cores = core, cores
            before = cpu.thread_ids()
            cpu.pin(core)
            backends.evaluates()  # MLX starts this thread's stream thread now, on its core (``cpu.one_core``)
            self._placed = sorted(cpu.thread_ids() - before | {threading.get_native_id()})
        try:
            try:
                self.rank = Rank(0, self._world_size, cores)
            except Exception as e:  # noqa: BLE001 - every job fails with it (``call``), rather than wait on nothing
                self._start_error = e
            while (job := self._jobs.get()) is not None and not self._abandoned.is_set():
                job()
        finally:
            backends.thread_ends()  # before ``close``'s join returns and the interpreter may exit

    def place(self, short: bool | None) -> None:
        """Where this thread, MLX's stream thread beside it and the event loop's thread (the caller's) run, by how
        long the engine's steps are as timed (None: not yet). Only for a rank alone on the Linux CPU backend
        (``one_core``); a no-op elsewhere.

        - Short, mostly host time: this thread hands MLX's stream thread hundreds of operations a step, a cheap
          switch on one core and a costly wake-up across two, so the two share one core (as they start); the event
          loop is kept off it, where a stream's write each token, and the client it wakes, would preempt the step.
        - Long, mostly the forward's own work (the quantized kernel's products): this thread builds each layer
          while the stream thread computes the one before (``rank.model.load.dispatch_layers``), and on one core
          they take turns, so both float over the rank's cores, as the loop does.
        """
        self._keep_loop_off(short is True)
        spread = short is False
        if self._core is None or spread == self._spread:
            return
        cpu.place(self._placed, self._cores if spread else self._core)
        self._spread = spread

    def _keep_loop_off(self, off: bool) -> None:
        """Keep the event loop's thread (the caller's) off this thread's core, or give it its cores back
        (``cpu.keep_off``, ``place``)."""
        if self._core is None or off == (self._loop_cores is not None):
            return
        if off:
            self._loop_cores = cpu.keep_off(self._caller, self._core)
        else:
            cpu.restore(self._caller, self._loop_cores)
            self._loop_cores = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def where(self) -> str:
        """Where this thread is now, innermost call last (``file:line in function``), for a log entry."""
        frame = sys._current_frames().get(self._thread.ident or 0)
        calls = traceback.extract_stack(frame)[-6:] if frame is not None else []
        return " > ".join(f"{Path(c.filename).name}:{c.lineno} in {c.name}" for c in calls)

    def abandon(self) -> None:
        """Leave this thread behind for good: it is wedged inside MLX (a collective of a lost group that no socket
        can end, see ``Pool.recover``). A fresh ``Rank0Thread`` takes its place; should this one ever come out,
        it runs no queued job (one would touch the group that replaced its own) and ends."""
        self._abandoned.set()
        self._jobs.put(None)
        self._keep_loop_off(False)

    async def call(self, fn: Callable[[Rank], T], deadline: float, abandon: Alarm | None = None) -> T:
        """Run ``fn(rank)`` on the rank-0 thread and return its result.

        The job is queued before this first yields to the event loop, so that rank 0
        starts at once, and the event loop's other work (the previous step's streams)
        runs beside it. Shielded: a cancelled caller still waits for the job, so a
        step is never torn. The wait ends early only with an error: ``TimeoutError``
        after ``deadline`` seconds, or ``Abandoned`` once ``abandon`` is set (a peer
        died, and rank 0 may wait inside a collective for it forever). Either way the
        job itself runs on; nothing can interrupt MLX.
        """
        loop = asyncio.get_running_loop()
        # One future, resolved by whichever comes first: the job's end (from rank 0's thread) or ``abandon``. No
        # task per wait and no round trip that blocks rank 0's thread until the event loop has run.
        woken: asyncio.Future[None] = loop.create_future()
        outcome: dict[str, Any] = {}

        def job() -> None:
            if self._abandoned.is_set():
                return
            try:
                if self.rank is None:
                    raise RuntimeError(f"rank 0 could not start: {self._start_error!r}")
                outcome["value"] = fn(self.rank)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises
                outcome["error"] = e
            try:
                loop.call_soon_threadsafe(_wake, woken)
            except RuntimeError:
                pass  # the event loop is gone; nobody is waiting
            if self.rank is not None and not self._abandoned.is_set():
                self.rank.ahead.settle(wait=False)  # the step run ahead, beside the event loop's work on this reply

        self._jobs.put(job)
        if abandon is not None:
            abandon.wakes(woken)
        with anyio.CancelScope(shield=True), anyio.move_on_after(deadline) as timer:
            await woken
        if "value" not in outcome and "error" not in outcome:
            if timer.cancelled_caught:
                raise TimeoutError(f"no result within {deadline:g} s")
            raise Abandoned("abandoned: a peer failed while rank 0 was inside the step")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    async def close(self, deadline: float) -> None:
        """Stop the thread and wait for it to end, so it never races the interpreter's exit.

        A thread wedged in a collective never ends; after ``deadline`` it is left
        behind (it is a daemon).
        """
        self._jobs.put(None)
        await anyio.to_thread.run_sync(self._thread.join, deadline)
        self._keep_loop_off(False)  # a process that opens another pool starts as it did


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():  # a deadline or an alarm may have ended the wait first
        woken.set_result(None)


class Alarm:
    """Set, on the event loop's thread, when rank 0 must stop waiting for its job (a worker was lost mid-step):
    the ``Rank0Thread.call`` watching it ends at once with ``Abandoned``."""

    __slots__ = ("_set", "_woken")

    def __init__(self) -> None:
        self._set = False
        self._woken: list[asyncio.Future[None]] = []

    def set(self) -> None:
        self._set = True
        for woken in self._woken:
            _wake(woken)
        self._woken.clear()

    def is_set(self) -> bool:
        return self._set

    def wakes(self, woken: asyncio.Future[None]) -> None:
        """Resolve ``woken`` when this is set (at once, if it is)."""
        if self._set:
            _wake(woken)
        else:
            self._woken.append(woken)
