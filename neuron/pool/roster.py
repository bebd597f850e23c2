"""The hosts as they change while serving: a rank moved to a spare (``spares.py`` decides when), a spare the operator
adds or forgets (``neuron hosts``), each checked as the hostfile's entries are, a host drained; every change written
back to the hostfile so that a restarted leader starts where this one left off. No MLX.

Why the whole file is rewritten, in the object form: the ranks' hosts change
too when a rank moves to a spare (``spares.py``), and what a restart must read
is where each rank runs now and which hosts stand by.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from neuron import metrics
from neuron.launch.checks import Refused
from neuron.launch.hostfile import Hostfile, check_distinct, host, write_hostfile
from neuron.launch.hosts import Host, HostsError, check_hosts
from neuron.pool.fanout import PoolError
from neuron.pool.ranks import Layout, Ranks
from neuron.pool.spares import Move, Spares
from neuron.rpc import HostInfo

log = structlog.get_logger("neuron.pool")

Probe = Callable[[Host], Awaitable[HostInfo]]
Shrunk = Callable[[list[int]], Layout]


@dataclass(frozen=True, slots=True)
class Shrink:
    """The group went on without ranks whose hosts stayed out of reach with no spare left, as the log, ``/v1/status``
    and the metrics tell it."""

    ranks: list[int]  # the ranks that left, as numbered before
    hosts: list[str]  # their hosts
    world_size: int  # the group's size after
    stages: int  # its pipeline stages after (1: tensor parallel)
    reason: str
    at: float  # unix seconds

    def describe(self) -> dict[str, object]:
        return {
            "ranks": self.ranks,
            "hosts": self.hosts,
            "world_size": self.world_size,
            "stages": self.stages,
            "reason": self.reason,
            "at": self.at,
        }


def log_move(move: Move) -> None:
    """Say in the log which rank moved where, and why: at start, in a recovery and in a drain alike."""
    log.warning(
        "rank moved to a spare",
        rank=move.rank,
        host=move.lost,
        spare=move.spare,
        out_s=round(move.out_s, 1),
        reason=move.reason,
    )


class HostsConflict(HostsError):
    """A change the group as it stands refuses (a host already in it, a rank's host named as a spare): 409."""

    status = 409


class NotShrunk(RuntimeError):
    """The group cannot go on without ``ranks``: the ranks that remain cannot serve the model (it does not split so,
    or a rank lacks the memory); the message says what is missing."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class NoSuchSpare(HostsError):
    """No spare (or host) by that name: 404."""

    status = 404


class Roster:
    """The ranks (their hosts are the launcher's), the spares (``Spares``') and the hostfile they are written back
    to; ``path`` is None for a group started without ``--hosts``, which has no hosts to reshape."""

    def __init__(self, ranks: Ranks, spares: Spares, path: str | Path | None, probe: Probe, shrunk: Shrunk) -> None:
        self._ranks = ranks
        self._probe = probe  # asks a new spare who it is (``probe.probe_spare``), refusing one unfit to serve
        self._shrunk = shrunk  # the layout without some ranks (``Loader.shrunk``), refused where it cannot serve
        self.shrinks: list[Shrink] = []
        self.launcher = ranks.launcher
        self.spares = spares
        self.backend = ranks.backend
        self.path = Path(path).resolve() if path else None

    def move_due(self, reason: str) -> list[Move]:
        """Between tries to recover: move every rank whose host has been out of reach past ``--spare-timeout`` to a
        spare (``Spares.move``), which the next try starts it on."""
        moves = self.spares.move(reason)
        for move in moves:
            self._ranks.place(move.rank, move.host)
            metrics.RANK_MOVES.labels("unreachable").inc()
        if moves:
            self.save()  # a restarted leader starts each rank where it runs now
        return moves

    async def shrink_due(self, reason: str) -> Shrink | None:
        """Between tries to recover, with no spare left: the group goes on without every rank whose host has been out
        of reach past ``--spare-timeout`` (``Spares.stranded``), the model split again over the ranks that remain
        (``Loader.shrunk``), which the next try starts; their hosts become spares, should they come back. None where
        no rank is stranded; ``NotShrunk``, saying what is missing, where the ranks that remain cannot serve."""
        lost = self.spares.stranded()
        if not lost:
            return None
        try:
            layout = self._shrunk(lost)
        except Refused as e:
            raise NotShrunk(str(e), lost) from None
        return await self._shrink(lost, layout, reason, spares=True)

    def shrink_plan(self, ranks: list[int]) -> Layout:
        """The layout without ``ranks``, whose host the operator drains with too few spares to take them; refused
        (409, saying what is missing) where the ranks that remain cannot serve the model."""
        try:
            return self._shrunk(ranks)
        except Refused as e:
            raise HostsConflict(f"{e}, and {len(self.spares.spares)} spare(s) stand by") from None

    async def shrink_drained(self, ranks: list[int], layout: Layout, reason: str) -> Shrink:
        """The group goes on without ``ranks``, whose host is drained (``shrink_plan`` chose ``layout``); the host
        leaves the hostfile, as a drained host does."""
        return await self._shrink(ranks, layout, reason, spares=False)

    async def _shrink(self, lost: list[int], layout: Layout, reason: str, spares: bool) -> Shrink:
        hosts = [self.launcher.hosts[rank] for rank in lost]
        await self._ranks.shrink(lost, layout)
        self.spares.dropped(lost, hosts if spares else [])
        metrics.GROUP_SHRINKS.inc()
        self.save()  # a restarted leader starts the smaller group
        shrink = Shrink(lost, [h.ssh for h in hosts], self.launcher.world_size, layout.stages, reason, time.time())
        self.shrinks.append(shrink)
        log.warning(
            "group shrunk",
            ranks=lost,
            hosts=shrink.hosts,
            world_size=shrink.world_size,
            stages=shrink.stages,
            reason=reason,
        )
        return shrink

    def stand_down(self, ranks: list[int], reason: str) -> PoolError:
        """At a step boundary: set the group aside for ``ranks``' host is drained, as if it were lost, so that the
        next recovery replaces it (and stops every worker of that host); why, naming the drained host."""
        return self._ranks.fan_out.stand_down({rank: reason for rank in ranks})

    def move_drained(self, ranks: list[int], reason: str) -> list[Move]:
        """Give each of ``ranks``, whose host is drained, a spare (``Spares.take``), which the recovery starts it
        on; the drained host leaves the hostfile."""
        moves = self.spares.take(ranks, reason)
        for move in moves:
            self._ranks.place(move.rank, move.host)
            metrics.RANK_MOVES.labels("drained").inc()
        self.save()
        return moves

    async def add(self, entry: Any) -> Host:
        """Add a spare, an entry shaped as the hostfile's; refused (naming what to fix) where it is not one, where it
        is a host of the group or already a spare, where it could not take a rank's place, and where it does not
        answer as a worker with the leader's versions and the memory for a rank's share (``probe_spare``)."""
        self._hostfile_needed("add a spare")
        spare = host(entry, "the new spare")
        self._check_new(spare)
        info = await self._probe(spare)
        self._check_new(spare)  # again: another add may have taken it while this one waited on the probe
        self.spares.add(spare)
        self.save()
        log.info(
            "spare added", host=spare.ssh, ips=list(spare.ips), hostname=info.hostname, spares=len(self.spares.spares)
        )
        return spare

    def _check_new(self, spare: Host) -> None:
        ranks = [rank for rank, h in enumerate(self.launcher.hosts) if h.machine == spare.machine]
        if ranks:
            raise HostsConflict(
                f"{spare.ssh} is already in the group (rank {', '.join(map(str, ranks))}): a spare is a host of its "
                "own; `neuron hosts` lists the group"
            )
        if any(s.machine == spare.machine for s in self.spares.spares):
            raise HostsConflict(f"{spare.ssh} is already a spare")
        hosts = list(self.launcher.hosts)
        check_hosts(hosts, self.backend, self.launcher.data_plane, (spare,))
        check_distinct(Hostfile(tuple(hosts), (*self.spares.spares, spare)), "with the new spare")

    def remove(self, ssh: str) -> Host:
        """Forget the spare ``ssh``; a rank's host is refused (it serves: it is not a spare)."""
        self._hostfile_needed("remove a spare")
        ranks = [rank for rank, h in enumerate(self.launcher.hosts) if h.ssh == ssh]
        if ranks:
            raise HostsConflict(
                f"{ssh} runs rank {', '.join(map(str, ranks))}, it is not a spare: `neuron hosts remove` forgets "
                "spares only"
            )
        removed = self.spares.remove(ssh)
        if removed is None:
            names = ", ".join(s.ssh for s in self.spares.spares) or "none"
            raise NoSuchSpare(f"{ssh} is not a spare (the spares: {names})")
        self.save()
        log.info("spare removed", host=ssh, spares=len(self.spares.spares))
        return removed

    def drain_plan(self, ssh: str) -> list[int]:
        """The ranks that run on ``ssh``, each of which a spare takes when it is drained, or, with too few spares,
        which the group goes on without (``shrink_plan``); refused for a host not in the group and the leader's own
        host (rank 0 runs inside the leader)."""
        self._hostfile_needed("drain a host")
        hosts = self.launcher.hosts
        ranks = [rank for rank, h in enumerate(hosts) if h.ssh == ssh]
        if not ranks:
            if any(s.ssh == ssh for s in self.spares.spares):
                raise HostsConflict(f"{ssh} is a spare, no rank runs there: `neuron hosts remove {ssh}` forgets it")
            names = ", ".join(dict.fromkeys(h.ssh for h in hosts))
            raise NoSuchSpare(f"{ssh} is not a host of the group (the hosts: {names})")
        if any(hosts[rank].machine == hosts[0].machine for rank in ranks):
            raise HostsConflict(
                f"{ssh} is the leader's own host (rank 0 runs inside the leader): drain another host, or stop the "
                "leader to take this one down"
            )
        return ranks

    def save(self) -> None:
        """Write the ranks' hosts and the spares back to the hostfile (nothing without one). A failure is logged,
        not raised: the change already holds in this process, and a move to a spare must not fail a recovery;
        the operator's commands were refused up front where the file cannot be written (``_hostfile_needed``)."""
        if self.path is None:
            return
        try:
            write_hostfile(self.path, Hostfile(tuple(self.launcher.hosts), tuple(self.spares.spares)))
        except OSError as e:
            log.warning(
                "hostfile not written back: a restarted leader will not know", path=str(self.path), error=str(e)
            )

    def _hostfile_needed(self, what: str) -> None:
        """Refused where the change could not be remembered: no hostfile, or one the leader cannot replace (it
        writes a file beside it, then renames it over)."""
        if self.path is None:
            raise HostsConflict(
                f"cannot {what}: this leader was started without --hosts, so every rank runs on its own host and "
                "there is no hostfile to keep the spares in; start it with --hosts FILE"
            )
        if not os.access(self.path.parent, os.W_OK):
            raise HostsConflict(
                f"cannot {what}: the leader cannot write in {self.path.parent}, where it keeps the hostfile's changes "
                "(it replaces the file); let the user neuron runs as write there, or move the hostfile"
            )
