"""A worker as a subprocess of the leader, on this host."""

from __future__ import annotations

import os
import sys

import anyio
import anyio.abc

from neuron.system import reexec
from neuron.system.systemd import ACTIVATION_ENV


def worker_command(rank: int, world_size: int) -> list[str]:
    return ["--worker", "--rank", str(rank), "--world-size", str(world_size)]


async def spawn_local(rank: int, world_size: int, extra: dict[str, str]) -> anyio.abc.Process:
    env = {**os.environ, **extra}
    # The workers speak to the leader, not to systemd: only the leader may notify, or take the activated socket
    # (a worker started before the leader has read the activation variables would otherwise inherit them).
    for name in ("NOTIFY_SOCKET", *ACTIVATION_ENV):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"
    return await anyio.open_process(
        [*reexec.command(), *worker_command(rank, world_size)],
        stdin=-1,
        stdout=-1,
        # The real stderr, not a pipe of ours: an unread one would block the worker once full. Not descriptor 2
        # either, which the leader's own native output goes through (log.NativeStderr).
        stderr=sys.stderr,
        env=env,
    )
