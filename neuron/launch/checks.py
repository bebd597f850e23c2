"""What the leader checks of its ranks before anything loads, and the two ways a start can fail.

``Refused``: a host that answers but must not serve with the others (another
version of neuron, MLX or mlx-lm; a different or missing model). Retrying
changes nothing until an operator acts, so the leader stops and says what to
change. ``Unreachable``: a host the leader cannot reach now (SSH fails, a
data-plane address does not answer, a worker dies while the group forms). The
leader keeps answering, says which host is missing, and tries again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from neuron import rpc
from neuron.launch.dataplane import machine_ranks, probe_peer, visible_gpus
from neuron.launch.hosts import SAME_VERSIONS, Host
from neuron.models.folder import first_difference

log = structlog.get_logger("neuron.launch")


class Refused(RuntimeError):
    """A host that must not serve with the others; the message names the rank, the host and both values, and
    ``ranks`` the ranks refused where one check names them (a spare is then passed over for the next)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class Unreachable(RuntimeError):
    """A host the leader cannot reach now; the message names the rank and the host."""

    def __init__(self, message: str, hosts: list[str]) -> None:
        super().__init__(message)
        self.hosts = hosts


def check_handshake(pongs: dict[int, rpc.Pong], mine: rpc.HostInfo, world_size: int, hosts: list[str]) -> None:
    """Every worker is the rank it was told, speaks this protocol, and runs the versions the leader runs."""
    for rank, pong in sorted(pongs.items()):
        where = f"rank {rank} on {hosts[rank]}"
        if (pong.rank, pong.world_size) != (rank, world_size):
            raise Refused(
                f"{where} answered as rank {pong.rank} of {pong.world_size}, not {rank} of {world_size}", (rank,)
            )
        if pong.protocol != rpc.PROTOCOL_VERSION:
            raise Refused(
                f"{where} speaks protocol {pong.protocol}, the leader {rpc.PROTOCOL_VERSION}: "
                "install the same neuron version on every host",
                (rank,),
            )
        for name in SAME_VERSIONS:
            theirs, ours = getattr(pong.host, name), getattr(mine, name)
            if theirs != ours:
                raise Refused(
                    f"{where} ({pong.host.hostname}) runs {name.replace('_', '-')} {theirs}, the leader {ours}: "
                    "install the same version on every host",
                    (rank,),
                )
        for name in ("python", "platform"):
            if getattr(pong.host, name) != getattr(mine, name):
                log.warning(
                    "hosts differ",
                    rank=rank,
                    host=hosts[rank],
                    field=name,
                    theirs=getattr(pong.host, name),
                    ours=getattr(mine, name),
                )


def check_gpus(backend: str, infos: list[rpc.HostInfo], hosts: list[Host], leader_visible: str | None) -> None:
    """With nccl, every machine has a GPU for each rank placed on it (``dataplane.spawn_env`` gives them out):
    counted from each host's handshake, and on the leader's machine from its ``CUDA_VISIBLE_DEVICES`` where it
    sets one. Two ranks on one GPU fail inside NCCL with words that do not say so."""
    if backend != "nccl" or len(hosts) < 2:
        return
    for first in sorted({machine_ranks(hosts, rank)[0] for rank in range(len(hosts))}):
        host, ranks = hosts[first], machine_ranks(hosts, first)
        allowed = visible_gpus(leader_visible) if host.local else None
        if allowed is None:
            count, source = infos[first].gpus, "as its driver lists them"
        else:
            count, source = len(allowed), f"CUDA_VISIBLE_DEVICES={leader_visible}"
        if count < len(ranks):
            names = ", ".join(map(str, ranks))
            raise Refused(
                f"{host.ssh} ({infos[first].hostname}) has {count} GPU{'' if count == 1 else 's'} ({source}), but "
                f"ranks {names} are placed on it: nccl needs a GPU of its own for each rank; place at most {count} "
                "there (a smaller --tp or --pp, or fewer hostfile entries naming it), or use --backend ring"
            )


@dataclass(frozen=True, slots=True)
class Crowded:
    """A machine whose ranks compute on its CPU and outnumber its cores. Such ranks take turns on a core: every
    collective waits on a rank that is not running, and a step takes longer than with one rank per core (a waiting
    rank sleeps, ``system.sockets.calm``, rather than spin on the core the other needs). It is served anyway (the
    operator may mean it, to try a split), with a warning at start and in ``/v1/status``."""

    host: str  # the hostfile's name for it (localhost: the leader's)
    hostname: str
    ranks: tuple[int, ...]
    cores: int

    @property
    def advice(self) -> str:
        return (
            f"{self.host} ({self.hostname}) runs {len(self.ranks)} ranks ({', '.join(map(str, self.ranks))}) on "
            f"{self.cores} core{'' if self.cores == 1 else 's'}: ranks that share a core take turns, and each "
            "waits in every collective for one that is not running, so a step takes longer than with a core for "
            f"each rank; place at most {self.cores} there (a smaller --tp or --pp, or fewer hostfile "
            "entries naming it)"
        )

    def describe(self) -> dict[str, Any]:
        return {"host": self.host, "hostname": self.hostname, "ranks": list(self.ranks), "cores": self.cores,
                "advice": self.advice}  # fmt: skip


def crowded(backend: str, infos: list[rpc.HostInfo], hosts: list[Host]) -> list[Crowded]:
    """The machines where ranks that compute on the CPU (a Linux host, not nccl's GPUs) outnumber the cores they
    may run on: those their hostfile entries pin them to where every one names its own, else those the first of
    them reported in its handshake."""
    out = []
    for first in sorted({machine_ranks(hosts, rank)[0] for rank in range(len(hosts))}):
        ranks, info = machine_ranks(hosts, first), infos[first]
        if len(ranks) < 2 or backend == "nccl" or not info.platform.lower().startswith("linux"):
            continue
        pinned = [hosts[r].cpus for r in ranks]
        cores = len(set().union(*pinned)) if all(pinned) else len(info.cpus)
        if 0 < cores < len(ranks):
            out.append(Crowded(hosts[first].ssh, info.hostname, tuple(ranks), cores))
    return out


def model_differences(
    checked: dict[int, rpc.ModelChecked], hosts: list[str], reads: list[list[str]] | None = None
) -> dict[int, str]:
    """Each rank whose host holds another model than rank 0's (or none), with what differs, in words. ``reads``:
    by rank, the safetensors files it loads from (``shares.files_read``; empty: every one), the only weights
    compared: a host that fetched a stage's files holds no others."""
    mine = checked[0]
    out = {}
    for rank, theirs in sorted(checked.items()):
        read = reads[rank] if reads else []
        if (name := first_difference(_as_read(mine.files, read), _as_read(theirs.files, read))) is not None:
            what = "lacks" if name not in theirs.files else "has a different"
            out[rank] = (
                f"rank {rank} on {hosts[rank]} holds another model than the leader: {theirs.path} {what} {name} "
                f"(the leader's is {mine.path})"
            )
    return out


def _as_read(files: dict[str, str], read: list[str]) -> dict[str, str]:
    """``files``' digests, of the safetensors files only those in ``read`` (all when it is empty)."""
    return {name: d for name, d in files.items() if not read or not name.endswith(".safetensors") or name in read}


def check_models(checked: dict[int, rpc.ModelChecked], hosts: list[str], reads: list[list[str]] | None = None) -> None:
    """Every host holds the model rank 0 holds: the same config, tokenizer and weights (those its ranks load,
    ``reads``), file by file."""
    for rank, message in model_differences(checked, hosts, reads).items():
        raise Refused(
            f"{message}; copy the same model folder to every host, or pass --push-model to have the leader send "
            "each host the share its ranks load",
            (rank,),
        )


def check_probes(probed: dict[int, dict[str, str]], backend: str, hosts: list[str], tunnelled: bool = False) -> None:
    """Every rank reached the addresses it will connect to when the group forms (through SSH tunnels: their
    ends on its own host)."""
    for rank, unreachable in sorted(probed.items()):
        for address, reason in sorted(unreachable.items()):
            target = probe_peer(backend, rank, len(hosts))
            where = f"rank {rank} on {hosts[rank]} cannot reach rank {target} on {hosts[target]}"
            if tunnelled:
                raise Unreachable(
                    f"{where} through the SSH tunnel at {address} ({reason}); the sshd of each host must allow TCP "
                    "forwarding (AllowTcpForwarding yes, the default)",
                    [hosts[target]],
                )
            raise Unreachable(
                f"{where} at {address} ({reason}); the data plane needs that address and port open between the two "
                "hosts",
                [hosts[target]],
            )


def check_memory(needs: list[int], infos: list[rpc.HostInfo], hosts: list[str]) -> None:
    """Every rank has room for its share of the weights (``needs``, by rank), as its handshake said: refused
    before anything loads, where the kernel's OOM killer would otherwise end a rank partway through."""
    for rank, (need, info) in enumerate(zip(needs, infos, strict=True)):
        if need > info.free_memory:
            limit = f" under its memory cgroup's limit of {size(info.memory_limit)}" if info.memory_limit else ""
            raise Refused(
                f"rank {rank} on {hosts[rank]} ({info.hostname}) needs {size(need)} for its share of the model's "
                f"weights, but has {size(info.free_memory)} available{limit}: split the model over more ranks "
                "(--tp or --pp, with more hosts in the hostfile), give that host more memory (or a higher limit), "
                "or serve a smaller or quantized model",
                (rank,),
            )


def size(count: int) -> str:
    """Bytes as an operator reads them: GiB from one, else MiB."""
    return f"{count / (1 << 30):.2f} GiB" if count >= 1 << 30 else f"{count / (1 << 20):.0f} MiB"
