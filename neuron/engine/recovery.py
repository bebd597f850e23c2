"""The engine's half that outlives a lost group (pause the batch, recover the pool in this process, resume),
and the probe that says the pool is ready.

A rank died, hung or was cut off: nothing fails at first. The batch goes back
to the queue (``Scheduler.pause``), the pool replaces every worker and rank 0's
group in this process (``Pool.recover``), and each paused sequence is fed its
prompt and output so far again and goes on as the loop admits it. Where the
pool cannot recover in this process, or not within ``resume_timeout``, every
request fails and ``lost`` is set: the leader restarts its process. The
decisions (whom a loss is blamed on, when a request gives up) are
``engine.resume``'s.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from neuron.engine import resume
from neuron.engine.output import Output
from neuron.engine.prefix import PrefixIndex
from neuron.engine.pressure import Pressure
from neuron.engine.scheduler import Scheduler, Scheduling
from neuron.log import ms_since
from neuron.pool import Pool, PoolError, Unrecoverable
from neuron.rpc import Prefill, StepPlan
from neuron.sampling_params import SamplingParams
from neuron.step import Start, Step

log = structlog.get_logger("neuron.engine")

RETRY_S = (1, 2, 4, 8, 15)  # seconds before recovering again after a failed try: soon at first


@dataclass(frozen=True, slots=True)
class Health:
    ready: bool
    reason: str  # why not ready, or "ready"


class Recovering:
    """The lost-group methods of ``Engine`` (which holds the state they share with its step loop)."""

    pool: Pool
    scheduler: Scheduler
    output: Output
    limits: Scheduling
    health: Health
    lost: anyio.Event
    recoveries: int
    events: deque[dict[str, Any]]  # the latest losses and recoveries, as the status route shows them
    prefix: PrefixIndex | None
    pressure: Pressure
    _in_flight: Step | None
    _wakeup: anyio.Event
    _busy_since: float | None

    if TYPE_CHECKING:  # the step loop's, in ``Engine``

        @property
        def waiting(self) -> int: ...

        @property
        def _resumes(self) -> bool: ...

        def _fail_all(self, kind: str, message: str) -> None: ...

    def _pause(self, error: PoolError, step: Step | None) -> None:
        """Put the batch back in the queue to be fed again once the pool is back (``Scheduler.pause``); a request
        blamed for too many losses ends here."""
        lost = resume.lost(error.failures, self.pool.hosts, str(error))
        tries = self.limits.resume_tries
        paused, given_up, cancelled = self.scheduler.pause(lost, resume.blamed(step, self.scheduler.batch), tries)
        for seq, steps_after in cancelled:
            self.output.cancelled(seq, steps_after)
        for seq in given_up:
            log.warning("not resumed", request_id=seq.request_id, losses=seq.losses, rank=lost.rank, host=lost.host)
            self.output.failed(seq, "step_failed", resume.too_many_losses(seq, tries, str(error)))
        if paused:
            log.warning("requests paused", requests=len(paused), rank=lost.rank, host=lost.host, cause=str(error))
        self._wakeup.set()

    async def _recover(self) -> None:
        """Replace the lost group in this process and probe it; the paused sequences then resume as the loop
        admits them. A try that fails (a host out of reach) is tried again, soon at first, for as long as
        ``resume_timeout`` lasts; paused sequences still waiting that long after their loss end with an error.
        Where recovery is not possible in this process, or has not succeeded by then, every request fails and
        ``lost`` is set (the leader restarts its process)."""
        cause = self.pool.broken
        started = time.perf_counter()
        self._busy_since = None  # not a wedged step: recovering has deadlines of its own
        log.warning("recovering", cause=str(cause), paused=self.waiting)
        ranks = sorted(cause.failures) if cause is not None else []
        self.events.append({"at": time.time(), "event": "lost", "ranks": ranks, "reason": str(cause)})
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._expire_paused)
            failure = await self._try_to_recover(cause, started)
            tg.cancel_scope.cancel()
        if failure is not None:
            log.error("recovery failed; restarting the leader", cause=str(cause), error=failure)
            self.health = Health(False, f"{cause}; recovery failed: {failure}")
            self.events.append({"at": time.time(), "event": "recovery failed", "ranks": ranks, "reason": failure})
            self.lost.set()
            self._fail_all("unavailable", f"{cause}; recovering in this process failed ({failure}): restarting")
            await anyio.sleep_forever()  # the leader cancels the engine and restarts
        self.recoveries += 1
        self.events.append({"at": time.time(), "event": "recovered", "ranks": ranks, "reason": str(cause)})
        log.info("recovered", cause=str(cause), ms=ms_since(started), in_process=True, paused=self.waiting)

    async def _try_to_recover(self, cause: PoolError | None, started: float) -> str | None:
        """``pool.recover``, a probe and every rank's memory read (the fresh ranks' MLX limits set), tried again after
        each failure while ``resume_timeout`` allows; None once the pool is back, else why not."""
        delays = iter(RETRY_S)
        while True:
            try:
                await self.pool.recover()
                if await self._probe():
                    await self.pressure.read()
                    return None
                raise RuntimeError(f"the first step after recovering failed: {self.health.reason}")
            except Unrecoverable as e:
                return str(e)
            except Exception as e:  # noqa: BLE001 - tried again while the time allows
                error = f"{type(e).__name__}: {e}"
                delay = next(delays, RETRY_S[-1])
                if time.perf_counter() - started + delay > self.limits.resume_timeout:
                    return error
                log.warning("recovery failed; trying again", cause=str(cause), error=error, retry_s=delay)
                self.health = Health(False, f"{cause}; recovering failed ({error}), next try in {delay} s")
                await anyio.sleep(delay)

    async def _expire_paused(self) -> None:
        """End each paused sequence still waiting ``resume_timeout`` s after the loss it waits on."""
        timeout = self.limits.resume_timeout
        while True:
            paused = [seq for seq in self.scheduler.waiting if seq.paused is not None and seq.paused.reason == "lost"]
            if not paused:
                return
            first = min(paused, key=lambda seq: seq.paused.at if seq.paused else 0.0)
            assert first.paused is not None
            await anyio.sleep(max(0.0, first.paused.at + timeout - time.perf_counter()))
            if first.paused is not None and self.scheduler.cancel(first):  # still waiting: it leaves the queue now
                self.output.failed(first, "unavailable", resume.timed_out(first.paused, timeout))

    def _on_lost(self, error: PoolError) -> None:
        """A worker exited: pause the batch now (or fail everything), even between steps; a step in flight
        fails on its own."""
        self._unready(error)
        if self._resumes:
            self._pause(error, self._in_flight)
        else:
            self._fail_all("unavailable", str(error))

    # Health.

    async def _clear_cache(self, prefixes: bool) -> None:
        """Free every rank's sequences; with ``prefixes`` (after a failure) the prefix cache too, on the leader
        as on every rank, so that both sides agree on it again."""
        if self.pool.broken is not None:
            return
        if prefixes and self.prefix is not None:
            self.prefix.clear()
        try:
            await self.pool.clear_kv_cache(prefixes)
        except PoolError as e:
            self._unready(e)

    async def _probe(self, tokens: int = 1) -> bool:
        """A prompt of ``tokens`` through every rank, from an empty cache (prefix cache included) and back to one."""
        if self.prefix is not None:
            self.prefix.clear()
        try:
            await self.pool.clear_kv_cache()
            prompt = [Prefill(0, 0, [0] * tokens, True)]
            await self.pool.step(Step(StepPlan(prefill=prompt), {0: Start(SamplingParams())}))
            await self.pool.clear_kv_cache()
        except PoolError as e:
            self._unready(e)
            return False
        if not self.health.ready:
            log.info("ready", world_size=self.pool.world_size)
        self.health = Health(True, "ready")
        return True

    def _unready(self, error: PoolError) -> None:
        self.health = Health(False, str(error))
        log.warning("not ready", reason=str(error), broken=error.broken)
        if error.broken and not self._resumes:
            self.lost.set()
