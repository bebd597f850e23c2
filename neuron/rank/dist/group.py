"""The process's place in an ``mx.distributed`` group: joining it, leaving it, and whether it is in one.

Why a module of its own: MLX keeps one distributed group per process. A
second ``mx.distributed.init`` hands back the first group (or a dead one after
a failure), so this process joins again only after ``leave`` has made MLX
forget the first (``rank.dist.backends``). That state belongs to the process, not to
any ``Rank``, and this is the only module that touches it (tests/unit/test_layout.py
checks that).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx

from neuron.rank.dist import backends
from neuron.rank.failures import GroupError, RankError
from neuron.rank.readback import scalar
from neuron.system import sockets

_in_group = False  # whether this process joined a group it has not left


def group_joined() -> bool:
    """Whether this process has joined a group it has not left (and so cannot join another now)."""
    return _in_group


def join_failure(backend: str, env: dict[str, str], error: Exception) -> str:
    """neuron's account of a failed join on this rank: the library's message alone (NCCL's ``invalid usage``)
    does not say that two ranks share a GPU, or which address every rank must reach."""
    said = f"{type(error).__name__}: {error}"
    if backend != "nccl":
        return f"could not join the {backend} group ({said}); check that every host reaches the others' addresses"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpu = f"CUDA_VISIBLE_DEVICES={visible}" if visible else "no CUDA_VISIBLE_DEVICES: the first GPU CUDA lists"
    rendezvous = f"{env.get('NCCL_HOST_IP', '?')}:{env.get('NCCL_PORT', '?')}"
    return (
        f"could not join the nccl group ({said}); check that this rank has a GPU of its own (it was given "
        f"{gpu}; nvidia-smi lists the host's GPUs, and no two ranks may share one), that "
        f"every host reaches rank 0's rendezvous at {rendezvous}, and that MLX for CUDA matches the driver "
        "(run with NCCL_DEBUG=INFO for NCCL's own account)"
    )


@contextlib.contextmanager
def _written(files: dict[str, str], prefix: str) -> Iterator[dict[str, str]]:
    """Each of ``files`` (variable: content) written, and the path each variable should point at. On Linux, a
    file in memory (memfd) that this process reads at ``/proc/self/fd/N`` and that ends with it; elsewhere, a
    temporary folder's, removed on the way out."""
    if hasattr(os, "memfd_create"):
        fds = {variable: os.memfd_create(prefix + variable.lower()) for variable in files}
        try:
            for variable, fd in fds.items():
                with open(fd, "w", closefd=False) as out:
                    out.write(files[variable])
            yield {variable: f"/proc/self/fd/{fd}" for variable, fd in fds.items()}
        finally:
            for fd in fds.values():
                os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        for variable, content in files.items():
            (Path(folder) / variable.lower()).write_text(content)
        yield {variable: str(Path(folder) / variable.lower()) for variable in files}


def join(
    rank: int, world_size: int, backend: str, env: dict[str, str], files: dict[str, str]
) -> tuple[mx.distributed.Group, float]:
    """Join the group as ``rank`` of ``world_size``, with ``env`` set and each of ``files`` (variable: content,
    the ring's hostfile) written where its variable points; the group and the sanity all-reduce of 1.0 from every
    rank. The files live only while MLX reads them, and on Linux only in memory: a process killed even while it
    joins (its peers never came) leaves nothing behind."""
    global _in_group
    if _in_group:
        raise RankError(
            f"rank {rank}: this process already joined an mx.distributed group, and MLX cannot "
            "join another; start a fresh process for a new group"
        )
    _in_group = True
    with _written(files, f"neuron-rank{rank}-") as paths:
        os.environ.update({**env, **paths})
        try:
            group = mx.distributed.init(strict=True, backend=backend)
        except Exception as e:  # the library's own words alone: say what to check
            raise GroupError(join_failure(backend, dict(os.environ), e)) from e
    if group.rank() != rank or group.size() != world_size:
        raise RankError(
            f"joined the {backend} group as rank {group.rank()} of {group.size()}, "
            f"expected rank {rank} of {world_size}: check MLX_RANK and the hostfile"
        )
    if backend == "ring":  # its threads would spin on the connections while they wait (``system.sockets.calm``)
        sockets.calm(json.loads(files["MLX_HOSTFILE"]))
    try:
        total = scalar(mx.distributed.all_sum(mx.array(1.0), group=group))
    except Exception as e:  # NCCL can fail at its first collective too
        raise GroupError(join_failure(backend, dict(os.environ), e)) from e
    return group, total


def leave() -> None:
    """Make MLX forget this process's group, so that ``join`` can form a fresh one; the caller has dropped every
    reference to the group first (the model's sharded layers hold it too). ``backends.NoClearBackends`` where
    MLX cannot."""
    global _in_group
    if _in_group:
        backends.clear_backends()
        _in_group = False
