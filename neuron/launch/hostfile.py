"""The hostfile an operator writes: read and checked before anything starts, written back when the hosts change while
serving (``neuron hosts add``, ``remove``; a rank moved to a spare).

Two forms. ``mlx.launch``'s list, one entry per rank, entry 0 the leader's own
host::

    [{"ssh": "localhost", "ips": ["10.0.0.1"]}, {"ssh": "me@mac2", "ips": ["10.0.0.2"]}]

or an object whose ``hosts`` is that list, with ``spares`` beside it: hosts in
the same entry shape that stand by to take a lost rank's place (``pool/spares.py``)::

    {"hosts": [...], "spares": [{"ssh": "me@mac3", "ips": ["10.0.0.3"]}]}

``backend`` and ``envs``, which ``mlx.launch`` also reads in the object, are
accepted and ignored (neuron takes them from its settings). Every problem is a
``HostsError`` naming the entry and what to change: one machine under two names,
a spare that is already a host of the group, a spare listed twice.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron.launch.hosts import Host, HostsError

KEYS = frozenset({"ssh", "ips", "rdma", "neuron", "model", "cpus"})
OBJECT_KEYS = frozenset({"hosts", "spares"})
MLX_LAUNCH_KEYS = frozenset({"backend", "envs"})  # mlx.launch's own; neuron has settings for them


@dataclass(frozen=True, slots=True)
class Hostfile:
    """The ranks' hosts, in rank order, and the spares, in the order they are taken."""

    hosts: tuple[Host, ...]
    spares: tuple[Host, ...] = ()


def read_hostfile(path: str | Path) -> Hostfile:
    """Parse and check a hostfile, in either form."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise HostsError(f"cannot read the hostfile {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise HostsError(f"the hostfile {path} is not valid JSON: {e}") from None
    return parse(raw, str(path))


def parse(raw: Any, where: str) -> Hostfile:
    """A hostfile's JSON value, checked; ``where`` (its path) starts every message."""
    spares: Any = []
    if isinstance(raw, dict):
        if unknown := sorted(set(raw) - OBJECT_KEYS - MLX_LAUNCH_KEYS):
            raise HostsError(f"the hostfile {where} has unknown keys {unknown}; known: {sorted(OBJECT_KEYS)}")
        raw, spares = raw.get("hosts"), raw.get("spares", [])
    if not isinstance(raw, list) or not raw:
        raise HostsError(
            f"the hostfile {where} must be a non-empty JSON list of hosts (or an object with one, 'hosts', and "
            "optionally 'spares')"
        )
    if not isinstance(spares, list):
        raise HostsError(
            f"the hostfile {where}: 'spares' must be a list of entries shaped as the hosts', got {spares!r}"
        )
    hostfile = Hostfile(
        tuple(host(entry, f"{where}, entry {i}") for i, entry in enumerate(raw)),
        tuple(host(entry, f"{where}, spare {i}") for i, entry in enumerate(spares)),
    )
    check_distinct(hostfile, where)
    return hostfile


def host(entry: Any, where: str) -> Host:
    """One entry, checked: ``where`` names it in every message."""
    if not isinstance(entry, dict):
        raise HostsError(f'{where} must be an object like {{"ssh": "mac2", "ips": ["10.0.0.2"]}}')
    if unknown := sorted(set(entry) - KEYS):
        raise HostsError(f"{where} has unknown keys {unknown}; known: {sorted(KEYS)}")
    ssh = entry.get("ssh")
    if not isinstance(ssh, str) or not ssh or ssh.startswith("-") or any(c.isspace() for c in ssh):
        raise HostsError(f"{where}: 'ssh' must be a host to reach over SSH (user@host), got {ssh!r}")
    ips = entry.get("ips", [])
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise HostsError(f"{where}: 'ips' must be a list of addresses, got {ips!r}")
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise HostsError(f"{where}: {ip!r} in 'ips' is not an IP address") from None
    rdma = entry.get("rdma", [])
    if not isinstance(rdma, list):
        raise HostsError(f"{where}: 'rdma' must be a list (one cell per rank), got {rdma!r}")
    cpus = entry.get("cpus", [])
    if not isinstance(cpus, list) or not all(type(c) is int and c >= 0 for c in cpus):
        raise HostsError(f"{where}: 'cpus' must be a list of core numbers, got {cpus!r}")
    for key in ("neuron", "model"):
        if key in entry and (not isinstance(entry[key], str) or not entry[key].strip()):
            raise HostsError(f"{where}: {key!r} must be a non-empty string, got {entry[key]!r}")
    return Host(ssh, tuple(ips), tuple(rdma), entry.get("neuron"), entry.get("model"), tuple(cpus))


def check_distinct(hostfile: Hostfile, where: str) -> None:
    """Each machine once among the spares, never both a host and a spare, and each address one machine's. Several
    ranks may share a host (entries naming the same ``ssh``): that is how a host runs several ranks."""
    ranks: dict[str, int] = {}
    for rank, h in enumerate(hostfile.hosts):
        ranks.setdefault(h.machine, rank)
    spares: dict[str, int] = {}
    for i, spare in enumerate(hostfile.spares):
        if spare.machine in ranks:
            raise HostsError(
                f"{where}, spare {i} ({spare.ssh}) is already a host of the group (entry {ranks[spare.machine]}): "
                "a spare stands by on a machine of its own; remove it from 'spares'"
            )
        if spare.machine in spares:
            raise HostsError(
                f"{where}, spare {i} ({spare.ssh}) repeats spare {spares[spare.machine]}: list each spare once"
            )
        spares[spare.machine] = i
    owners: dict[str, tuple[str, str]] = {}
    named = [(f"entry {r}", h) for r, h in enumerate(hostfile.hosts)] + [
        (f"spare {i}", s) for i, s in enumerate(hostfile.spares)
    ]
    for name, h in named:
        for ip in h.ips:
            owner = owners.setdefault(ip, (name, h.machine))
            if owner[1] != h.machine:
                raise HostsError(
                    f"{where}: {owner[0]} ({owner[1]}) and {name} ({h.ssh}) both give the address {ip}: one machine "
                    "under two names, or a copied entry; give each host its own 'ips'"
                )


def check_spare_timeout(spare_timeout: float, resume_timeout: float) -> None:
    """A rank moves to a spare while the requests in flight still wait for it: within ``--resume-timeout``."""
    if resume_timeout <= 0:
        raise HostsError(
            "the hostfile names spares, but --resume-timeout is 0, so a lost rank ends every request and restarts "
            "the leader before any spare could take its place: give --resume-timeout a number of seconds"
        )
    if spare_timeout >= resume_timeout:
        raise HostsError(
            f"--spare-timeout {spare_timeout:g} must be shorter than --resume-timeout {resume_timeout:g}: the "
            "requests in flight wait for a lost rank only that long, so its spare must be brought in sooner"
        )


def entry(h: Host) -> dict[str, Any]:
    """A host as a hostfile entry: the keys it was given, as an operator would write them."""
    out: dict[str, Any] = {"ssh": h.ssh}
    if h.ips:
        out["ips"] = list(h.ips)
    if h.rdma:
        out["rdma"] = list(h.rdma)
    if h.neuron is not None:
        out["neuron"] = h.neuron
    if h.model is not None:
        out["model"] = h.model
    if h.cpus:
        out["cpus"] = list(h.cpus)
    return out


def write_hostfile(path: str | Path, hostfile: Hostfile) -> None:
    """Write ``hostfile`` in the object form, replacing ``path`` at once (a reader never sees half a file): what
    changed while serving is what the next start reads."""
    path = Path(path)
    value = {"hosts": [entry(h) for h in hostfile.hosts], "spares": [entry(s) for s in hostfile.spares]}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(temporary, path)
