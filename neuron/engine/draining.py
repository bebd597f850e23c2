"""A host the operator drains while serving (``neuron hosts drain HOST``): its ranks move to spares at a step
boundary, or, with too few spares, the group goes on without them, and no stream ends.

Why a drain is a recovery the operator asks for: the ranks' group cannot be
changed in place (MLX's sharded layers hold the group they were made with), so
moving a rank means a fresh group, which is what recovering a lost one builds.
At a step boundary the batch is paused as for a loss, though no request counts
a loss (nothing failed); the group is set aside naming the drained host; each
of its ranks is given a spare (``Roster.move_drained``), or the group drops them
(``Roster.shrink_drained``: the model split again over the ranks left); and the recovery starts
every worker afresh (the drained host's are stopped), re-forms the group and
resumes the paused requests with the text they would have had. The drained host
leaves the hostfile; ``neuron hosts add`` brings it back as a spare.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import structlog

from neuron.engine.recovery import Recovery
from neuron.pool import Layout, Pool
from neuron.pool.roster import HostsConflict
from neuron.pool.spares import Move

log = structlog.get_logger("neuron.engine")


class DrainFailed(HostsConflict):
    """The ranks moved, but the group could not be re-formed in this process (the leader restarts): 503."""

    status = 503


@dataclass(slots=True)
class Drain:
    """One drain asked of the loop, and what came of it."""

    host: str
    ranks: list[int]
    shrunk: Layout | None  # the layout without ``ranks``, where too few spares stand by to take them
    done: anyio.Event = field(default_factory=anyio.Event)
    moves: list[Move] = field(default_factory=list)
    failure: str | None = None


class Drains:
    """The drain the operator asked, run by the engine's loop (the only code that drives the pool) at its next step
    boundary; the caller waits for it."""

    def __init__(self, pool: Pool, recovery: Recovery) -> None:
        self.pool = pool
        self.recovery = recovery
        self.asked: Drain | None = None

    async def drain(self, host: str) -> Drain:
        """Drain ``host``: returns once its ranks run on spares (or the group went on without them) and the group
        serves again. Refused (a ``HostsError`` saying why) while another drain or a recovery runs, and where
        ``Roster.drain_plan`` refuses (a host not in the group, the leader's own) or, with too few spares,
        ``Roster.shrink_plan`` (the ranks left cannot serve the model)."""
        if self.asked is not None:
            raise HostsConflict(f"a drain of {self.asked.host} is under way: wait for it to finish")
        if not self.recovery.resumes:
            raise HostsConflict(
                "a drain pauses the requests in flight while the group re-forms, which --resume-timeout 0 does not "
                "allow: give it a number of seconds"
            )
        health = self.recovery.health
        if not health.ready or self.pool.broken is not None:
            raise HostsConflict(f"the group is not serving ({health.reason}): drain once it is ready")
        roster = self.pool.roster
        ranks = roster.drain_plan(host)
        shrunk = roster.shrink_plan(ranks) if len(roster.spares.spares) < len(ranks) else None
        self.asked = drain = Drain(host, ranks, shrunk)
        log.info("draining", host=host, ranks=drain.ranks)
        self.recovery.wake()
        await drain.done.wait()
        if drain.failure is not None:
            done = "moved to spares" if shrunk is None else "were left out"
            raise DrainFailed(f"{host}'s ranks {done}, but the group did not form again: {drain.failure}")
        return drain

    @staticmethod
    def said(drain: Drain) -> str:
        """What a drain did, as ``neuron hosts drain`` prints it."""
        if drain.shrunk is None:
            return f"drained {drain.host}: " + ", ".join(f"rank {m.rank} moved to {m.spare}" for m in drain.moves)
        ranks = ", ".join(map(str, drain.ranks))
        layout = drain.shrunk
        over = f"{layout.stages} pipeline stages" if layout.stages > 1 else f"{layout.launcher.world_size} rank(s)"
        return f"drained {drain.host}: no spare stood by, so the group went on without rank {ranks}, over {over}"

    async def run(self) -> None:
        """On the loop, between steps: pause the batch without blame, set the group aside, give each of the host's
        ranks a spare, and recover onto them."""
        drain = self.asked
        assert drain is not None
        reason = f"{drain.host} drained by the operator (neuron hosts drain)"
        try:
            error = self.pool.roster.stand_down(drain.ranks, reason)
            self.recovery.unready(error)
            self.recovery.pause(error, None, blame=False)
            if drain.shrunk is None:
                drain.moves = self.pool.roster.move_drained(drain.ranks, reason)
                self.recovery.record_moves(drain.moves)
            else:
                shrink = await self.pool.roster.shrink_drained(drain.ranks, drain.shrunk, reason)
                self.recovery.record_shrink(shrink)
            await self.recovery.recover()
        except BaseException as e:
            cancelled = isinstance(e, anyio.get_cancelled_exc_class())
            drain.failure = "the leader is restarting" if cancelled else f"{type(e).__name__}: {e}"
            raise
        finally:
            self.asked = None
            drain.done.set()
        log.info("drained", host=drain.host, moves=[m.describe() for m in drain.moves])
