"""The hosts as an operator reshapes them while serving (``neuron hosts``): which host each rank runs on and in what
state, the spares, a spare added or forgotten, each checked as the hostfile's entries are, and every change written
back to the hostfile so that a restarted leader starts where this one left off. No MLX.

Why the whole file is rewritten, in the object form: the ranks' hosts change
too when a rank moves to a spare (``spares.py``), and what a restart must read
is where each rank runs now and which hosts stand by.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from neuron.launch.hostfile import Hostfile, check_distinct, host, write_hostfile
from neuron.launch.hosts import Host, HostsError, check_hosts
from neuron.launch.launcher import Launcher
from neuron.pool.spares import Spares

log = structlog.get_logger("neuron.pool")


class HostsConflict(HostsError):
    """A change the group as it stands refuses (a host already in it, a rank's host named as a spare): 409."""

    status = 409


class NoSuchSpare(HostsError):
    """No spare (or host) by that name: 404."""

    status = 404


class Roster:
    """The ranks' hosts (the launcher's), the spares (``Spares``') and the hostfile they are written back to;
    ``path`` is None for a group started without ``--hosts``, which has no hosts to reshape."""

    def __init__(self, launcher: Launcher, spares: Spares, backend: str, path: str | Path | None) -> None:
        self.launcher = launcher
        self.spares = spares
        self.backend = backend
        self.path = Path(path).resolve() if path else None

    def add(self, entry: Any) -> Host:
        """Add a spare, an entry shaped as the hostfile's; refused (naming what to fix) where it is not one, where it
        is a host of the group or already a spare, or where it could not take a rank's place."""
        self._hostfile_needed("add a spare")
        spare = host(entry, "the new spare")
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
        self.spares.add(spare)
        self.save()
        log.info("spare added", host=spare.ssh, ips=list(spare.ips), spares=len(self.spares.spares))
        return spare

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
        """The ranks that run on ``ssh``, each of which a spare will take when it is drained; refused for a host
        not in the group, the leader's own host (rank 0 runs inside the leader), and where too few spares stand
        by (the group does not shrink yet)."""
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
        if len(self.spares.spares) < len(ranks):
            raise HostsConflict(
                f"{ssh} runs rank {', '.join(map(str, ranks))}, but {len(self.spares.spares)} spare(s) stand by to "
                "take its place: add one first with `neuron hosts add` (shrinking the group instead is not there yet)"
            )
        return ranks

    def save(self) -> None:
        """Write the ranks' hosts and the spares back to the hostfile (nothing without one)."""
        if self.path is not None:
            write_hostfile(self.path, Hostfile(tuple(self.launcher.hosts), tuple(self.spares.spares)))

    def _hostfile_needed(self, what: str) -> None:
        if self.path is None:
            raise HostsConflict(
                f"cannot {what}: this leader was started without --hosts, so every rank runs on its own host and "
                "there is no hostfile to keep the spares in; start it with --hosts FILE"
            )
