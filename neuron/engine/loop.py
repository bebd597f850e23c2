"""The engine's step loop: the one task that drives the pool.

Why one task: the pool's ranks must see the same steps in the same order, so exactly one caller may drive it.
Requests never touch the pool; they queue a ``Sequence`` and read its events (``engine.engine``). Each turn the
loop asks the draft model for its rows' proposals (``--draft-model``: before the plan is made, so that the plan
carries them and is never changed after), has the scheduler decide the step (``Scheduler.schedule``), runs it on
every rank, and hands what was sampled back to the scheduler and the output.

Why cancellation waits for the step boundary: a step handed to the workers must finish on every rank (the pool
shields it), or a rank is left inside a collective. A caller that goes away only marks its sequence; the loop
drops it before the next step (it leaves in that step's plan); the others keep going.

Readiness: the engine is ready once a probe step has succeeded on every rank since the last failure. A failed step
(or a desync) fails the sequences in the batch, clears every rank's cache, makes the engine unready (requests get
503), and probes again at once, then every few seconds until a probe passes. A lost group pauses the batch instead
(``engine.recovery``), and an allocation that failed anyway pauses it within a lower budget (``engine.pressure``).

Every few seconds the loop has a step read every rank's memory, all at the same step, and the memory budget follows
the readings (``engine.pressure``). The loop also keeps the steps of the last minutes, second by second
(``Recent``), for the status route's charts: a page opened now should see the minutes before it, and a scrape's
counters hold only totals since the process started.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import anyio
import structlog

from neuron import metrics
from neuron.engine.draining import Drains
from neuron.engine.output import Output
from neuron.engine.prefix_disk import PrefixDisk
from neuron.engine.pressure import Pressure
from neuron.engine.recovery import Recovery
from neuron.engine.scheduler import Scheduler
from neuron.log import trace, tracing
from neuron.pool import Pool, PoolError
from neuron.step import Step

log = structlog.get_logger("neuron.engine")

REPROBE_S = 5.0
KEPT_S = 300  # how long the status route's charts look back
# How often a step reads every rank's memory: often enough for the budget to follow a host that fills up, and rare
# enough to cost a step nothing in the mean (a reading is a few small files, or MLX's counters, on every rank).
MEMORY_EVERY_S = 5.0


class Loop:
    def __init__(
        self,
        pool: Pool,
        scheduler: Scheduler,
        output: Output,
        recovery: Recovery,
        pressure: Pressure,
        disk: PrefixDisk | None,
        fail_all: Callable[[str, str], None],
        drains: Drains,
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.output = output
        self.recovery = recovery
        self.drains = drains
        self.pressure = pressure
        self.disk = disk
        self.fail_all = fail_all
        self.recent = Recent()  # the steps of the last minutes, for the status route's charts
        self.wakeup = anyio.Event()  # set when a request is queued
        self.idle = anyio.Event()  # set when nothing is queued or running
        self.busy_since: float | None = None  # when the loop's current pool call began; None while it waits
        self.probe_failed = False  # True while the loop waits to probe again
        self._tracing = tracing()
        # Every few seconds a step reads every rank's memory, and the budget follows the readings (``Pressure``).
        self.memory_due = Every(MEMORY_EVERY_S)

    def wake(self) -> None:
        """A request was queued (or the batch changed between steps): the loop takes it up."""
        self.idle = anyio.Event()
        self.wakeup.set()

    def busy_for(self) -> float:
        """Seconds the loop has spent on its current turn (0 while idle): how a wedged step shows."""
        return 0.0 if self.busy_since is None else time.monotonic() - self.busy_since

    async def run(self) -> None:
        """The only code that drives the pool, until cancelled."""
        scheduler, recovery = self.scheduler, self.recovery
        while True:
            self.busy_since = time.monotonic()
            if self.pool.broken is not None and recovery.resumes:
                self.busy_since = None  # not a wedged step: recovering has deadlines of its own
                await recovery.recover()
                continue
            if self.drains.asked is not None:  # a step boundary: the operator's drain runs here (``draining``)
                self.busy_since = None
                await self.drains.run()
                continue
            if not recovery.health.ready and self.pool.broken is None and not await recovery.probe():
                self.fail_all("unavailable", f"not ready: {recovery.health.reason}")
                self.busy_since = None
                self.probe_failed = True
                await anyio.sleep(REPROBE_S)
                self.probe_failed = False
                continue
            if self.disk is not None and scheduler.prefix is not None and scheduler.waiting:
                await self.disk.reload(self.pool, scheduler.prefix, scheduler.admissible())
            started = time.perf_counter()
            try:
                proposed = await self._propose()
            except PoolError as e:
                await self._failed(e, None)
                continue
            draft_ms = (time.perf_counter() - started) * 1000
            turn = scheduler.schedule(proposed)
            for seq, steps_after in turn.cancelled:
                self.output.cancelled(seq, steps_after)
            for seq in turn.admitted:
                if seq.paused is None:  # a paused sequence was started before, and resumes (``Output.resumed``)
                    self.output.started(seq)
            if turn.preempted or turn.unfit:
                self.pressure.said(turn.preempted, turn.unfit)
            if turn.step is not None:
                await self._step(turn.step, max(map(len, proposed.values()), default=0), draft_ms)
                continue
            if turn.clear:  # nothing left to run: one clear frees every rank's caches at once (prefixes stay)
                await recovery.clear_cache(prefixes=False)
            if not scheduler.waiting:
                self.idle.set()
                self.wakeup = anyio.Event()
                self.busy_since = None
                await self.wakeup.wait()

    async def _propose(self) -> dict[int, list[int]]:
        """The draft model's tokens for the rows that draft with it (``Scheduler.to_draft``), proposed on rank 0,
        which keeps their distributions for the step that verifies them."""
        rows = self.scheduler.to_draft()
        return await self.pool.draft(rows) if rows else {}

    async def _step(self, step: Step, draft_steps: int, draft_ms: float) -> None:
        started = time.perf_counter()
        plan = step.plan
        self.recovery.in_flight = step
        try:
            read_memory = self.memory_due()
            sampled = await self.pool.step(step, read_memory)
            metrics.PREFILL_TOKENS.inc(plan.prefill_tokens)
        except PoolError as e:
            await self._failed(e, step)
            return
        finally:
            self.recovery.in_flight = None
        ms = (time.perf_counter() - started) * 1000
        if read_memory:
            self.pressure.follow()
        metrics.PREFIX_EVICTIONS.inc(len(plan.evict))
        if self.disk is not None:
            self.disk.written(step.spilled)
        cost = self.scheduler.cost
        cost.observe_draft(draft_steps, draft_ms)  # priced apart from the step's own time (``drafts.width``)
        deliveries = self.scheduler.update(step, sampled, ms)
        for seq in dict.fromkeys((*self.scheduler.batch, *(d.seq for d in deliveries))):
            if seq.trace is not None:  # before its deliveries: the last one closes its span
                seq.trace.stepped(started, self.pool.timing.ranks)
        if self.scheduler.running:  # between requests it stays as the last batch left it
            self.pool.place_rank0(self.scheduler.steps_short)
        self.recent.add((ms + draft_ms) / 1000, sum(1 for d in deliveries if d.kept))
        if self._tracing:  # its fields cost a step's host time even when dropped
            self._trace_step(step, ms, draft_ms)
        for delivery in deliveries:
            self.output.deliver(delivery)

    def _trace_step(self, step: Step, ms: float, draft_ms: float) -> None:
        plan, cost = step.plan, self.scheduler.cost
        trace(
            log,
            "step",
            decode_rows=len(plan.decode),
            rows_fed=plan.rows_fed,
            prefill_tokens=plan.prefill_tokens,
            budget=step.budget,
            ms=round(ms + draft_ms, 2),
            draft_ms=round(draft_ms, 2),
            draft_step_ms=round(cost.draft_step_ms, 2),
            fixed_ms=round(cost.fixed_ms, 2),
            row_ms=round(cost.row_ms, 3),
            token_ms=None if cost.token_ms is None else round(cost.token_ms, 3),
            pair_ms=round(cost.pair_ms, 6),
        )

    async def _failed(self, error: PoolError, step: Step | None) -> None:
        """A step (or the draft model's proposals for it) failed on some rank."""
        recovery = self.recovery
        if error.out_of_memory and (recovery.resumes or not error.broken):
            # A rank failed to allocate anyway: the batch resumes within a lower budget (``Pressure.failed``), on
            # these ranks, their caches freed, or where peers may wait in a collective, on fresh ones.
            for seq, steps_after in self.pressure.failed(error):
                self.output.cancelled(seq, steps_after)
            self.wake()
            if not error.broken:
                with anyio.CancelScope(shield=True):
                    await recovery.clear_cache(prefixes=True)
                return
        recovery.unready(error)
        if error.broken and recovery.resumes:
            if not error.out_of_memory:
                recovery.pause(error, step)
            return
        # A lost group is a server that is about to restart (503, retry), not a failed request (500).
        self.fail_all("unavailable" if error.broken else "step_failed", str(error))
        with anyio.CancelScope(shield=True):
            await recovery.clear_cache(prefixes=True)


class Every:
    """Whether something done at most once every ``seconds`` is due now: it is the first time, and a call that says
    so counts as doing it."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self.at: float | None = None

    def __call__(self) -> bool:
        now = self.clock()
        if self.at is not None and now - self.at < self.seconds:
            return False
        self.at = now
        return True


class Recent:
    """Per-second sums over the last ``kept`` seconds: ``[second, steps, step seconds, tokens]``."""

    def __init__(self, kept: int = KEPT_S) -> None:
        self.kept = kept
        self._seconds: deque[list[float]] = deque(maxlen=kept)

    def add(self, seconds: float, tokens: int, now: float | None = None) -> None:
        second = float(int(time.time() if now is None else now))
        if self._seconds and self._seconds[-1][0] == second:
            bucket = self._seconds[-1]
            bucket[1] += 1
            bucket[2] += seconds
            bucket[3] += tokens
        else:
            self._seconds.append([second, 1, seconds, tokens])

    def seconds(self, now: float | None = None) -> list[list[float]]:
        """The seconds with steps among the last ``kept``, oldest first (a second without one is left out)."""
        since = int(time.time() if now is None else now) - self.kept
        return [list(bucket) for bucket in self._seconds if bucket[0] > since]
