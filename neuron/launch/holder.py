"""Ring connections held open once the process behind them is gone, so that no peer's transfers fail before the
leader stands in for them.

Why: MLX's ring gives each socket a thread that, after ten failed transfers in a
row, fails what is pending on it and ends. A collective queued on that socket
afterwards (the rest of a step rank 0 had already built) waits forever, with
rank 0's thread, and through MLX's scheduler, which counts every stream's queued
work, every other thread of the leader (``pool.replacement``'s
``Replacement._abandon_rank0``). A worker that dies closes its sockets, and its
peers see that within microseconds: sooner than the leader can put its stand-in
(``dataplane.Sink``) under its own ends.

So a worker, once in a ring, hands copies of its connections to a tiny process
of its own, the holder. While the worker lives the holder only waits. Then:

- the worker is gone (killed, crashed, out of memory): its copies keep the
  connections open, and it reads and drops every byte its peers send and sends
  zeros, so every collective they have queued completes, with values nobody
  reads (a dead worker never replies to the step, so the leader breaks the
  pool), and their threads come out;
- the worker's pipe to its leader closed (``hold_silently``): the leader may
  live on behind a cut SSH session, rank 0 still in the group, so the holder
  keeps the connections open but answers nothing (below); and two holders of
  workers whose leader is gone never answer each other;
- the worker leaves in order, told so by its leader (``release``): it ends.

It ends when every peer has closed its end (they left the group, or the
leader's sink took their ends over) or ``HOLD_S`` after the worker.

With ``--data-plane ssh`` rank 0's peers on its own machine are the leader's
ssh connections, whose forwards carry its links to other hosts: a tunnel
killed closes rank 0's connections as a dead worker's would. So the leader
holds those too (``hold_tunnel``), with copies taken out of the ssh process
(``pidfd_getfd``), silently: the workers behind a tunnel live on, and one can
finish a step whose last bytes to rank 0 died with ssh, so zeros there would be
read as a step's values. Unanswered, rank 0's transfers wait, as on a stopped
peer, for the leader, which notices the loss, to put its ``Sink`` under rank
0's ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import socket
import subprocess

from neuron.launch.watchdog import companion
from neuron.system.sockets import group_sockets

# Seconds a holder keeps the connections after the process behind them is gone: past the leader's leaving a lost
# group, which it does within seconds of noticing the loss.
HOLD_S = 60.0

# The holder's program: argv: the pipe's read end (the worker's, or the leader's for a tunnel: ``RELEASE`` or
# ``SILENT`` written, or its end of file), ``HOLD_S``, the pidfd of the ssh process whose ends it holds (-1 for a
# worker's holder), then the connections' descriptors. It answers with zeros only for a worker that is gone without a
# word. Standard library only (it runs with ``-S``), and none of the words a process listing looks for to find
# workers.
RELEASE, SILENT = b"x", b"s"
HOLDER = f"""
import os, select, socket, sys, time
life, most, ssh = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
ends = [socket.socket(fileno=int(fd)) for fd in sys.argv[4:]]
ready = select.select([life] + ([ssh] if ssh >= 0 else []), [], [])[0]
said = os.read(life, 1) if life in ready else b""
if said == {RELEASE!r} or (ssh >= 0 and life in ready):
    sys.exit(0)  # left in order, or the leader is gone with its rank 0: nobody waits on these connections
answer = ssh < 0 and not said  # the worker is gone without a word
watch = [life] if ssh >= 0 else []  # the leader, alive, may still close the tunnel in order
for end in ends:
    end.setblocking(False)
zeros = bytes(1 << 16)
deadline = time.monotonic() + most
while ends and time.monotonic() < deadline:
    readable, writable, _ = select.select(watch + ends, ends if answer else [], [], 0.5)
    if set(watch) & set(readable):
        sys.exit(0)
    for end in set(readable) | set(writable):
        try:
            if end in readable and not end.recv(1 << 16):
                raise ConnectionError("closed by the peer")
            if end in writable:
                end.send(zeros)
        except BlockingIOError:
            continue
        except OSError:
            ends.remove(end)
            end.close()
"""
PIDFD_GETFD = 438  # the syscall's number, the same on every architecture Linux has added it to (5.6 on)


def hold(hostfile: str) -> int:
    """Start this worker's holder on its connections to the ring ``hostfile`` (the ring's addresses, JSON, as this
    rank sees them); how many it holds. None is started where the worker has none (a group of one)."""
    fds = group_sockets(json.loads(hostfile), connected=True)
    if not fds:
        return 0
    write_end, holder = companion(HOLDER, str(HOLD_S), "-1", *map(str, fds), pass_fds=tuple(fds))
    _keep[write_end] = holder
    return len(fds)


def hold_tunnel(pid: int, ours: list[int]) -> tuple[int, subprocess.Popen[bytes]] | None:
    """Start a holder behind this process's connections ``ours`` (descriptors) whose other ends are in process
    ``pid`` (an ssh carrying the ring's links); returns its pipe's write end, which ``release_tunnel`` closes in
    order, and the holder; None where none of ``ours`` ends there (a connection that carries only links relayed
    between two other hosts). ``OSError`` where the kernel will not lend the ends (before Linux 5.6, or a process
    this one may not trace)."""
    wanted = set()
    for fd in ours:
        with socket.socket(fileno=os.dup(fd)) as sock:
            wanted.add((sock.getpeername()[:2], sock.getsockname()[:2]))
    pidfd = os.pidfd_open(pid)
    copies: list[int] = []
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
            except OSError:
                continue  # closed since the listing
            copy = _copy_of(pidfd, int(name))
            if copy is None:
                continue
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(copy)) as sock:
                if (sock.getsockname()[:2], sock.getpeername()[:2]) in wanted:
                    copies.append(copy)
                    continue
            os.close(copy)
        if not copies:
            return None
        return companion(HOLDER, str(HOLD_S), str(pidfd), *map(str, copies), pass_fds=(pidfd, *copies))
    finally:
        for fd in (pidfd, *copies):
            os.close(fd)


def release_tunnel(write_end: int) -> None:
    """The tunnel closes in order: its holder ends without holding anything."""
    _tell(write_end, RELEASE)
    os.close(write_end)


def _copy_of(pidfd: int, fd: int) -> int | None:
    """A copy, in this process, of the descriptor ``fd`` of the process ``pidfd`` names; None where it was closed
    meanwhile. ``OSError`` where the kernel refuses the copy."""
    copy = _libc().syscall(PIDFD_GETFD, pidfd, fd, 0)
    if copy >= 0:
        return int(copy)
    error = ctypes.get_errno()
    if error == errno.EBADF:  # closed since the listing
        return None
    raise OSError(error, f"pidfd_getfd: {os.strerror(error)}")


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def release() -> None:
    """This worker leaves in order, its leader said so: its holder ends without answering for it."""
    _say(RELEASE)


def hold_silently() -> None:
    """This worker leaves because its pipe to the leader closed: its holder keeps the connections, unanswered."""
    _say(SILENT)


def _say(word: bytes) -> None:
    for write_end in _keep:
        _tell(write_end, word)


def _tell(write_end: int, word: bytes) -> None:
    with contextlib.suppress(OSError):  # the holder already gone
        os.write(write_end, word)


_keep: dict[int, subprocess.Popen[bytes]] = {}  # the pipe's write end, open for the life of this process
