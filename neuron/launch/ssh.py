"""A worker on another host, started over SSH: the same protocol on the ssh process's stdin and stdout.

``ssh -T`` (no terminal: nothing but the worker's output on stdout) with
``BatchMode`` (never a password prompt: keys only) and a short connect timeout,
so an unreachable host fails in seconds. The remote command is ``exec``'d, so
the worker is the session's process: when the SSH session ends, its stdin
closes and it exits, and nothing is left behind on that host.

With ``--data-plane ssh`` the leader opens one more SSH connection to each
host that carries a tunnel, a ControlMaster (``tunnel_argv``) whose session
only waits for its stdin to close, and adds the tunnels to it as port forwards
(``forward``, ``ssh -O forward``). Not on the worker's own connection: ssh
stays up while a forwarded connection is open, and rank 0's end of the ring
lives as long as the leader, so a worker's ssh would outlive its worker and
hide its loss.

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
from pathlib import Path

import anyio
import anyio.abc
import orjson
import structlog

from neuron.launch.hosts import Host
from neuron.launch.local import worker_command
from neuron.log import trace
from neuron.system import reexec

log = structlog.get_logger("neuron.worker")

SSH_OPTIONS = ("-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=5")
LEVELS = ("debug", "info", "warning", "error", "critical")
TUNNEL_READY = "neuron-tunnel-ready"


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


# The tunnel connection's session: says it is up, then lasts until the leader closes its stdin (or dies).
TUNNEL_SESSION = f"echo {TUNNEL_READY}; exec cat >/dev/null"


def tunnel_argv(ssh_command: list[str], host: str, control: Path) -> list[str]:
    """An SSH connection to ``host`` that is a ControlMaster on ``control``, for ``forward`` to add to."""
    master = ("-o", "ControlMaster=yes", "-o", f"ControlPath={control}", "-o", "ControlPersist=no")
    return [*ssh_command, *SSH_OPTIONS, *master, "--", host, TUNNEL_SESSION]


class ForwardError(RuntimeError):
    """A tunnel connection or forward ssh could not make; the message is ssh's own words."""


def forward_argv(
    ssh_command: list[str], control: Path, host: str, flag: str, spec: str, op: str = "forward"
) -> list[str]:
    """Ask the ControlMaster on ``control`` to add (``op`` forward) or take down (cancel) ``flag spec``."""
    return [*ssh_command, "-o", "BatchMode=yes", "-S", str(control), "-O", op, flag, spec, "--", host]


async def run_forward(argv: list[str], timeout: float) -> None:
    """Run a ``forward_argv``; ssh returns once the forward listens (for ``-R``, once sshd said so) or is down.
    Raises ``ForwardError`` with ssh's words."""
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    with anyio.fail_after(timeout):
        done = await anyio.run_process(argv, check=False, env=env)
    if done.returncode != 0:
        said = (done.stderr or b"").decode(errors="replace").strip().replace("\r", "").replace("\n", "; ")
        raise ForwardError(said or f"ssh -O exited {done.returncode}")


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
    return await _spawn(ssh_argv(ssh_command, host, rank, world_size, extra), rank, host.ssh)


async def _spawn(argv: list[str], rank: int, host: str) -> tuple[anyio.abc.Process, StderrRelay]:
    read_end, write_end = os.pipe()
    try:
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        process = await anyio.open_process(argv, stdin=-1, stdout=-1, stderr=write_end, env=env)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return process, StderrRelay(read_end, rank, host)


async def spawn_tunnel(
    ssh_command: list[str], host: str, control: Path, rank: int
) -> tuple[anyio.abc.Process, StderrRelay]:
    """Start the tunnel connection to ``host`` (its stderr logged as ``rank``'s, the first rank there); returns
    once its session runs, so its control socket listens. Raises ``ForwardError`` with ssh's words when it ends
    first; a cancelled start leaves no process."""
    process, relay = await _spawn(tunnel_argv(ssh_command, host, control), rank, host)
    assert process.stdout is not None
    said = b""
    try:
        async for chunk in process.stdout:
            said += chunk
            if TUNNEL_READY.encode() in said:
                return process, relay
        await process.wait()
    except BaseException:
        process.kill()
        with anyio.CancelScope(shield=True):
            await process.wait()
            await process.aclose()
        raise
    await process.aclose()
    raise ForwardError(relay.last_words() or f"ssh exited with code {process.returncode}")


async def read_remote(ssh_command: list[str], host: Host, path: str) -> str | None:
    """A small file on ``host`` (a dead worker's OOM count), or None when it cannot be read."""
    argv = [*ssh_command, *SSH_OPTIONS, "--", host.ssh, shlex.join(["cat", path])]
    try:
        done = await anyio.run_process(argv, stdin=subprocess.DEVNULL, check=False)
    except OSError:
        return None
    return done.stdout.decode(errors="replace") if done.returncode == 0 else None
