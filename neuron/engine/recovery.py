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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from neuron.engine import resume
from neuron.engine.output import Output
from neuron.engine.pressure import Pressure
from neuron.engine.scheduler import Scheduler
from neuron.log import ms_since
from neuron.pool import NotShrunk, Pool, PoolError, Unrecoverable, ranks_named
from neuron.pool.roster import Shrink, log_move
from neuron.pool.spares import Move
from neuron.rpc import Prefill, StepPlan
from neuron.sampling_params import SamplingParams
from neuron.step import Start, Step

log = structlog.get_logger("neuron.engine")

RETRY_S = (1, 2, 4, 8, 15)  # seconds before recovering again after a failed try: soon at first
EVENTS_KEPT = 20


@dataclass(frozen=True, slots=True)
class Health:
    ready: bool
    reason: str  # why not ready, or "ready"


class Recovery:
    """A lost group's handling and the pool's readiness, for the engine's step loop: the batch paused (its streams
    open), the group replaced in this process and probed, the paused requests given up past ``resume_timeout``;
    the health the server's routes read. It fails requests through ``fail_all`` and wakes the loop with ``wake``,
    the engine's."""

    def __init__(
        self,
        pool: Pool,
        scheduler: Scheduler,
        output: Output,
        pressure: Pressure,
        fail_all: Callable[[str, str], None],
        wake: Callable[[], None],
        reshape: Callable[[], None],
    ) -> None:
        self.pool = pool
        self.reshape = reshape  # the engine's: its budget and prefix cache follow a group that shrank
        self.reshaped = False  # the group shrank since it last served: the recovery calibrates the budget again
        self.scheduler = scheduler
        self.output = output
        self.pressure = pressure
        self.limits = scheduler.limits
        self.fail_all = fail_all
        self.wake = wake
        self.health = Health(False, "not probed yet")
        # Set once the group is lost for good (lost, and not recovered in this process): only a fresh leader
        # process can serve again.
        self.lost = anyio.Event()
        self.in_flight: Step | None = None  # the step the pool is running, whom a loss is blamed on
        self.recoveries = 0  # lost groups replaced in this process
        # The latest losses and recoveries, as the status route shows them: a poll may fall between the two.
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)

    @property
    def resumes(self) -> bool:
        """Whether a lost group pauses the batch (rather than failing it, and the leader restarting)."""
        return self.limits.resume_timeout > 0 and not self.lost.is_set()

    def pause(self, error: PoolError, step: Step | None, blame: bool = True) -> None:
        """Put the batch back in the queue to be fed again once the pool is back (``Scheduler.pause``); a request
        blamed for too many losses ends here. Without ``blame`` (a drained host: nothing failed) no request counts
        a loss."""
        lost = resume.lost(error.failures, self.pool.hosts, str(error))
        tries = self.limits.resume_tries
        blamed = resume.blamed(step, self.scheduler.batch) if blame else set()
        paused, given_up, cancelled = self.scheduler.queues.pause(lost, blamed, tries)
        for seq, steps_after in cancelled:
            self.output.cancelled(seq, steps_after)
        for seq in given_up:
            log.warning("not resumed", **seq.ids, losses=seq.losses, rank=lost.rank, host=lost.host)
            self.output.failed(seq, "step_failed", resume.too_many_losses(seq, tries, str(error)))
        if paused:
            log.warning("requests paused", requests=len(paused), rank=lost.rank, host=lost.host, cause=str(error))
        self.wake()

    async def recover(self) -> None:
        """Replace the lost group in this process and probe it; the paused sequences then resume as the loop
        admits them. A try that fails (a host out of reach) is tried again, soon at first, for as long as
        ``resume_timeout`` lasts; paused sequences still waiting that long after their loss end with an error.
        Where recovery is not possible in this process, or has not succeeded by then, every request fails and
        ``lost`` is set (the leader restarts its process)."""
        cause = self.pool.broken
        started = time.perf_counter()
        log.warning("recovering", cause=str(cause), paused=len(self.scheduler.waiting))
        ranks = sorted(cause.failures) if cause is not None else []
        event = "drained" if cause is not None and cause.op == "drain" else "lost"
        self.events.append({"at": time.time(), "event": event, "ranks": ranks, "reason": str(cause)})
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._expire_paused)
            failure = await self._try_to_recover(cause, started)
            tg.cancel_scope.cancel()
        if failure is not None:
            log.error("recovery failed; restarting the leader", cause=str(cause), error=failure)
            self.health = Health(False, f"{cause}; recovery failed: {failure}")
            self.events.append({"at": time.time(), "event": "recovery failed", "ranks": ranks, "reason": failure})
            self.lost.set()
            self.fail_all("unavailable", f"{cause}; recovering in this process failed ({failure}): restarting")
            await anyio.sleep_forever()  # the leader cancels the engine and restarts
        self.recoveries += 1
        self.events.append({"at": time.time(), "event": "recovered", "ranks": ranks, "reason": str(cause)})
        log.info(
            "recovered", cause=str(cause), ms=ms_since(started), in_process=True, paused=len(self.scheduler.waiting)
        )

    async def _try_to_recover(self, cause: PoolError | None, started: float) -> str | None:
        """``pool.recover``, a probe and every rank's memory read (the fresh ranks' MLX limits set), tried again after
        each failure while ``resume_timeout`` allows; None once the pool is back, else why not. Between tries, a
        rank whose host has stayed out of reach past ``--spare-timeout`` moves to a spare (``pool.spares``), and
        the next try follows at once."""
        spares = self.pool.spares
        spares.failed(sorted(cause.failures) if cause is not None else [])
        delays = iter(RETRY_S)
        refused: str | None = None  # why the group could not shrink, this recovery
        while True:
            try:
                await self.pool.recover()
                reshaped = self.reshaped
                if reshaped:
                    self.reshape()
                if await self.probe(self.pressure.budget.calibration_tokens if reshaped else 1):
                    await self.pressure.read(calibrate=reshaped)
                    self.reshaped = False
                    spares.recovered()
                    return None
                raise RuntimeError(f"the first step after recovering failed: {self.health.reason}")
            except Unrecoverable as e:
                return str(e)
            except Exception as e:  # noqa: BLE001 - tried again while the time allows
                error = f"{type(e).__name__}: {e}"
                named = ranks_named(e, self.pool.hosts)
                spares.failed(named or [], answered=named is not None)
                changed, refused = await self._reshape(error, refused)
                if changed:
                    delays = iter(RETRY_S)
                    continue
                delay: float = next(delays, RETRY_S[-1])
                for due in (spares.until_due(), None if refused else spares.until_stranded()):
                    if due is not None:
                        delay = min(delay, due)  # a move (or a shrink) is not put off by a long pause between tries
                if time.perf_counter() - started + delay > self.limits.resume_timeout:
                    return error
                log.warning("recovery failed; trying again", cause=str(cause), error=error, retry_s=round(delay, 1))
                missing = f"; the group cannot shrink: {refused}" if refused else ""
                self.health = Health(False, f"{cause}; recovering failed ({error}), next try in {delay:.0f} s{missing}")
                await anyio.sleep(delay)
                # A move that came due during the pause goes first: another try at the lost host would wait out
                # its SSH connection timeout before the move.
                changed, refused = await self._reshape(error, refused)
                if changed:
                    delays = iter(RETRY_S)

    async def _reshape(self, error: str, refused: str | None) -> tuple[bool, str | None]:
        """The ranks out of reach too long moved to spares, or, with none left, left behind (once: ``refused``
        says why the group could not shrink, and the ranks that remain do not change while it waits); whether the
        group changed, and ``refused`` as it stands now."""
        if self._move_to_spares(error):
            return True, refused
        if refused is None:
            return await self._shrink(error)
        return False, refused

    def _move_to_spares(self, error: str) -> bool:
        """Move the ranks whose hosts have been out of reach too long to spares, and say so; whether any moved."""
        bound = self.pool.spares.bound_s
        moves = self.pool.roster.move_due(f"out of reach for over {bound:g} s (--spare-timeout): {error}")
        self.record_moves(moves)
        return bool(moves)

    async def _shrink(self, error: str) -> tuple[bool, str | None]:
        """With no spare left, go on without the ranks whose hosts have been out of reach past ``--spare-timeout``
        (``Roster.shrink_due``), and say so; whether the group shrank, and why it could not (once: the ranks that
        remain do not change while it waits)."""
        reason = f"out of reach for over {self.pool.spares.bound_s:g} s (--spare-timeout), and no spare left: {error}"
        try:
            shrink = await self.pool.roster.shrink_due(reason)
        except NotShrunk as e:
            log.error("group not shrunk", reason=str(e))
            self.events.append({"at": time.time(), "event": "not shrunk", "ranks": e.ranks, "reason": str(e)})
            return False, str(e)
        if shrink is None:
            return False, None
        self.record_shrink(shrink)
        return True, None

    def record_shrink(self, shrink: Shrink) -> None:
        """Say in the status's events that the group shrank (the roster logged it), and calibrate the budget at the
        next recovery's end, whether a loss or a drain shrank it."""
        what = f"{shrink.stages} pipeline stages" if shrink.stages > 1 else f"{shrink.world_size} rank(s)"
        reason = f"went on without {', '.join(shrink.hosts)} over {what}: {shrink.reason}"
        self.events.append({"at": shrink.at, "event": "shrunk", "ranks": shrink.ranks, "reason": reason})
        self.reshaped = True

    def record_moves(self, moves: list[Move]) -> None:
        """Say each rank's move in the log and in the status's events, whether a loss or a drain moved it."""
        for move in moves:
            log_move(move)
            reason = f"rank {move.rank} moved from {move.lost} to the spare {move.spare}: {move.reason}"
            self.events.append({"at": move.at, "event": "moved", "ranks": [move.rank], "reason": reason})

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
            if first.paused is not None and self.scheduler.queues.cancel(
                first
            ):  # still waiting: it leaves the queue now
                self.output.failed(first, "unavailable", resume.timed_out(first.paused, timeout))

    def on_lost(self, error: PoolError) -> None:
        """A worker exited: pause the batch now (or fail everything), even between steps; a step in flight
        fails on its own."""
        self.unready(error)
        if self.resumes:
            self.pause(error, self.in_flight)
        else:
            self.fail_all("unavailable", str(error))

    # Health.

    async def clear_cache(self, prefixes: bool) -> None:
        """Free every rank's sequences; with ``prefixes`` (after a failure) the prefix cache too, on the leader
        as on every rank, so that both sides agree on it again."""
        if self.pool.broken is not None:
            return
        if prefixes and self.scheduler.prefix is not None:
            self.scheduler.prefix.clear()
        try:
            await self.pool.clear_kv_cache(prefixes)
        except PoolError as e:
            self.unready(e)

    async def probe(self, tokens: int = 1) -> bool:
        """A prompt of ``tokens`` through every rank, from an empty cache (prefix cache included) and back to one."""
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.clear()
        try:
            await self.pool.clear_kv_cache()
            prompt = [Prefill(0, 0, [0] * tokens, True)]
            await self.pool.step(Step(StepPlan(prefill=prompt), {0: Start(SamplingParams())}))
            await self.pool.clear_kv_cache()
        except PoolError as e:
            self.unready(e)
            return False
        if not self.health.ready:
            log.info("ready", world_size=self.pool.world_size)
        self.health = Health(True, "ready")
        return True

    def unready(self, error: PoolError) -> None:
        self.health = Health(False, str(error))
        log.warning("not ready", reason=str(error), broken=error.broken)
        if error.broken and not self.resumes:
            self.lost.set()
