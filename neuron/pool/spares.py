"""Spares: hosts that stand by to take the place of a rank whose host stays out of reach. The rule alone, no I/O.

A lost group is replaced in this process (``replacement.py``), tried again and
again while ``--resume-timeout`` lasts. Without spares, a host that died for
good is tried until then, and every request in flight ends. With spares, each
failed try says which ranks it could not reach (``failed``); a rank whose host
has been out of reach for ``--spare-timeout`` seconds since it was first named
moves to the first spare (``due``, then ``move``), and the next try starts its
worker there. A host that answers within the bound keeps its rank (a flapping
link moves nothing): a try that no longer names it ends its outage.

Why the lost host goes to the back of the spares rather than away: it may come
back (a reboot, a cable), and it is then a spare like any other; until then it
is tried only after every other spare, and a rank moved to it while it is still
down moves on after another bound. A spare that dies while it is brought in is
the same case: its rank is out of reach again, and moves on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from neuron.launch.checks import Refused, Unreachable
from neuron.launch.hosts import Host
from neuron.pool.fanout import PoolError


@dataclass(frozen=True, slots=True)
class Move:
    """A rank moved from one host to another, and why, as the log, ``/v1/status`` and the metrics tell it."""

    rank: int
    lost: str  # the host it left (as the hostfile names it)
    spare: str  # the host it moved to
    out_s: float  # how long the lost host had been out of reach
    reason: str
    at: float  # unix seconds
    host: Host  # the spare's entry, which takes the rank's place

    def describe(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "from": self.lost,
            "to": self.spare,
            "out_s": round(self.out_s, 1),
            "reason": self.reason,
            "at": self.at,
        }


class Spares:
    """The spares, in the order they are taken, and how long each rank's host has been out of reach.

    ``hosts``, the ranks' hosts by rank, is read only: the pool puts each move's
    spare in it (``Ranks.place``), where every later start reads it.
    """

    def __init__(
        self,
        hosts: list[Host],
        spares: Iterable[Host],
        bound_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hosts = hosts
        self.spares = list(spares)
        self.bound_s = bound_s
        self.clock = clock
        self.out: dict[int, float] = {}  # rank -> when its host was first named out of reach, this outage
        self.returning: set[str] = set()  # hosts that lost a rank, spares again (tried last) until one answers
        self.moves: list[Move] = []

    def failed(self, ranks: Iterable[int], answered: bool = True, since: float | None = None) -> None:
        """A try (or the loss itself) could not reach ``ranks``. Each is out of reach from the first time it was
        named (``since``, where an earlier leader process named it); with ``answered``, a rank no longer named
        reached its host, and its outage ends. Rank 0 is the leader's own: it never moves."""
        now = self.clock() if since is None else since
        named = {rank: self.out.get(rank, now) for rank in ranks if rank != 0}
        self.out = named if answered else {**self.out, **named}

    def recovered(self) -> None:
        """Every rank answered: no outage is left, and every host that holds a rank is no longer returning."""
        self.out.clear()
        self.returning -= {h.ssh for h in self.hosts}

    def due(self) -> list[int]:
        """The ranks out of reach for the bound or longer, while a spare is left to take them."""
        return self._past_bound()[: len(self.spares)]

    def stranded(self) -> list[int]:
        """The ranks out of reach for the bound or longer that no spare is left to take: the group may shrink
        without them (``Roster.shrink_due``)."""
        return self._past_bound()[len(self.spares) :]

    def _past_bound(self) -> list[int]:
        now = self.clock()
        return sorted(rank for rank, since in self.out.items() if now - since >= self.bound_s)

    def dropped(self, ranks: list[int], hosts: list[Host]) -> None:
        """``ranks`` left the group (it shrank: ``hosts`` were theirs): their outages end, each rank above them
        moves down past them, and their hosts become spares, tried last, should they come back."""
        gone = sorted(ranks)
        self.out = {
            rank - sum(1 for g in gone if g < rank): since for rank, since in self.out.items() if rank not in gone
        }
        for host in hosts:
            self.spares.append(host)
            self.returning.add(host.ssh)

    def until_due(self) -> float | None:
        """Seconds until the next rank out of reach is due to move, where a spare could take it; None if none."""
        if not self.out or not self.spares:
            return None
        return max(0.0, min(self.out.values()) + self.bound_s - self.clock())

    def until_stranded(self) -> float | None:
        """Seconds until a rank out of reach passes the bound with no spare left to take it (``stranded``); None
        where the spares can take every rank out of reach."""
        if len(self.out) <= len(self.spares):
            return None
        return max(0.0, sorted(self.out.values())[len(self.spares)] + self.bound_s - self.clock())

    def move(self, reason: str) -> list[Move]:
        """Every rank that is due, each given the first spare: its host goes to the back of the spares, and its
        outage starts again, as the spare's own. The caller puts each spare in the rank's place."""
        moves = []
        now = self.clock()
        for rank in self.due():
            spare = self.spares.pop(0)
            lost = self.hosts[rank]
            self.spares.append(lost)
            self.returning.add(lost.ssh)
            moves.append(Move(rank, lost.ssh, spare.ssh, now - self.out[rank], reason, time.time(), spare))
            self.out[rank] = now
        self.moves += moves
        return moves

    def take(self, ranks: list[int], reason: str) -> list[Move]:
        """A spare for each of ``ranks``, whose host the operator drains (``Roster.drain_plan`` checked there are
        enough): the drained host leaves the group and the spares alike, and each spare gets its own bound."""
        now = self.clock()
        moves = []
        for rank in ranks:
            spare = self.spares.pop(0)
            moves.append(Move(rank, self.hosts[rank].ssh, spare.ssh, 0.0, reason, time.time(), spare))
            self.out[rank] = now
        self.moves += moves
        return moves

    def add(self, host: Host) -> None:
        self.spares.append(host)

    def remove(self, ssh: str) -> Host | None:
        """Forget the spare named ``ssh``; None where there is none."""
        found = next((s for s in self.spares if s.ssh == ssh), None)
        if found is not None:
            self.spares.remove(found)
            self.returning.discard(ssh)
        return found

    def describe(self) -> list[dict[str, object]]:
        """The spares as ``/v1/status`` lists them, in the order they are taken."""
        return [
            {"host": s.ssh, "state": "returning" if s.ssh in self.returning else "standing by"} for s in self.spares
        ]


def ranks_named(error: BaseException, hosts: list[str]) -> list[int] | None:
    """The ranks a failed try could not reach or use, by rank; None where the error names none (it says nothing of
    which hosts answered)."""
    if isinstance(error, PoolError):
        return sorted(error.failures)
    if isinstance(error, Unreachable):
        return [rank for rank, host in enumerate(hosts) if host in error.hosts]
    if isinstance(error, Refused) and error.ranks:
        return list(error.ranks)
    return None
