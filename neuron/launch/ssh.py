"""A worker on another host, started over SSH: the same protocol on the ssh process's stdin and stdout.

``ssh -T`` (no terminal: nothing but the worker's output on stdout) with
``BatchMode`` (never a password prompt: keys only) and a short connect timeout,
so an unreachable host fails in seconds. The remote command is ``exec``'d, so
the worker is the session's process: when the SSH session ends, its stdin
closes and it exits, and nothing is left behind on that host.

The worker's stderr comes back through ssh; a thread reads it line by line (an
unread pipe would block the worker once full) and logs each line again in the
leader's log with the worker's rank and host, since a remote worker cannot
reach the leader's journal. The last lines are kept for error messages: when
ssh itself fails, its own words say why.
"""

from __future__ import annotations

import collections
import os
import shlex
import subprocess
import threading

import anyio
import anyio.abc
import orjson
import structlog

from neuron import reexec
from neuron.launch.hosts import Host
from neuron.launch.local import worker_command
from neuron.log import trace

log = structlog.get_logger("neuron.worker")

SSH_OPTIONS = ("-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=5")
LEVELS = ("debug", "info", "warning", "error", "critical")


def remote_command(host: Host, rank: int, world_size: int, env: dict[str, str] | None = None) -> str:
    """What the remote shell runs: neuron's worker, replacing the shell, with ``env`` set through ``env(1)``."""
    neuron = shlex.split(host.neuron) if host.neuron else reexec.command()
    setting = ["env", *(f"{name}={value}" for name, value in sorted((env or {}).items()))] if env else []
    return "exec " + shlex.join([*setting, *neuron, *worker_command(rank, world_size)])


def receiver_argv(ssh_command: list[str], host: Host, key: str) -> list[str]:
    """The session that receives a share of the model on ``host`` (``launch/push.py``), beside the worker's."""
    neuron = shlex.split(host.neuron) if host.neuron else reexec.command()
    return [*ssh_command, *SSH_OPTIONS, "--", host.ssh, "exec " + shlex.join([*neuron, "--receive-share", key])]


def ssh_argv(
    ssh_command: list[str], host: Host, rank: int, world_size: int, env: dict[str, str] | None = None
) -> list[str]:
    return [*ssh_command, *SSH_OPTIONS, "--", host.ssh, remote_command(host, rank, world_size, env)]


class StderrRelay:
    """Reads a remote worker's stderr on a thread; logs each line in the leader's log; keeps the last few."""

    def __init__(self, fd: int, rank: int, host: str) -> None:
        self.rank = rank
        self.host = host
        self.tail: collections.deque[str] = collections.deque(maxlen=8)
        self._thread = threading.Thread(target=self._run, args=(fd,), name=f"neuron-relay-{rank}", daemon=True)
        self._thread.start()

    def _run(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as stream:
            for raw in stream:
                line = raw.decode(errors="replace").rstrip()
                if line:
                    self._relay(line)

    def _relay(self, line: str) -> None:
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            entry = None
        if not isinstance(entry, dict) or "event" not in entry:
            self.tail.append(line)
            log.warning("worker output", rank=self.rank, host=self.host, line=line)
            return
        level = str(entry.pop("level", "info"))
        event = str(entry.pop("event"))
        entry.pop("timestamp", None)
        entry.update(rank=self.rank, host=self.host)
        if level in ("warning", "error", "critical"):
            self.tail.append(f"{event} {entry.get('error', '')}".strip())
        if level == "trace":
            trace(log, event, **entry)
        else:
            getattr(log, level if level in LEVELS else "info")(event, **entry)

    def last_words(self) -> str:
        """The last lines kept, once the process has ended (the thread reads to the pipe's end first)."""
        self._thread.join(timeout=1.0)
        return "; ".join(self.tail)


async def spawn_ssh(
    ssh_command: list[str], host: Host, rank: int, world_size: int, extra: dict[str, str]
) -> tuple[anyio.abc.Process, StderrRelay]:
    read_end, write_end = os.pipe()
    try:
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        process = await anyio.open_process(
            ssh_argv(ssh_command, host, rank, world_size, extra), stdin=-1, stdout=-1, stderr=write_end, env=env
        )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return process, StderrRelay(read_end, rank, host.ssh)


async def read_remote(ssh_command: list[str], host: Host, path: str) -> str | None:
    """A small file on ``host`` (a dead worker's OOM count), or None when it cannot be read."""
    argv = [*ssh_command, *SSH_OPTIONS, "--", host.ssh, shlex.join(["cat", path])]
    try:
        done = await anyio.run_process(argv, stdin=subprocess.DEVNULL, check=False)
    except OSError:
        return None
    return done.stdout.decode(errors="replace") if done.returncode == 0 else None
