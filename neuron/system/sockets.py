"""This process's sockets of an ``mx.distributed`` ring group, found by address, and made to wait in the kernel.

``group_sockets`` finds a group's listeners and connections among this process's descriptors (the launch's
data plane cuts and holds them; the rank makes them wait). No MLX here.

Why ``calm``: MLX's ring gives each connection a thread that, while a transfer is pending, calls ``recv`` and
``send`` on its non-blocking socket in a loop with no wait (``SocketThread::worker``). A rank waiting for a peer's
part of a collective burns a core on that loop, and where ranks outnumber cores it takes the core the peer needs to
finish its part: SmolLM2 over three ranks on two cores decoded under 3 tokens a second. Made blocking with a short
timeout each way, the same calls sleep in the kernel until bytes arrive (woken at once) and return ``EAGAIN`` after
the timeout, which the loop reads as "nothing yet", so a send queued behind a waiting ``recv`` on one connection
waits at most that long (BENCHMARKS.md, "Ring threads that wait").
"""

from __future__ import annotations

import os
import socket
import struct

# How long one ``recv`` or ``send`` on a ring connection waits in the kernel before MLX's loop goes round.
WAIT_US = 100


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def group_sockets(addresses: list[list[str]], connected: bool = False) -> list[int]:
    """This process's descriptors of sockets bound to or connected to one of a group's ``addresses``; with
    ``connected``, of connections alone (no listener)."""
    wanted = {split_address(a) for rank in addresses for a in rank}
    directory = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    found = []
    for name in os.listdir(directory):
        try:
            copy = os.dup(int(name))
        except OSError:
            continue  # closed meanwhile (the directory's own descriptor among them)
        try:
            sock = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)
            continue  # not a socket
        with sock:
            try:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                ends = {sock.getsockname()[:2]}
                try:
                    ends.add(sock.getpeername()[:2])
                except OSError:
                    if connected:
                        continue
                    # a listener: no peer
                if ends & wanted:
                    found.append(int(name))
            except OSError:
                continue
    return found


def calm(addresses: list[list[str]], wait_us: int = WAIT_US) -> int:
    """Make this process's connections to the ring ``addresses`` wait in the kernel (``WAIT_US``) rather than MLX's
    thread spin on them; how many. Call it once the group has formed: MLX makes them non-blocking as it does."""
    timeout = struct.pack("ll", wait_us // 1_000_000, wait_us % 1_000_000)
    fds = group_sockets(addresses, connected=True)
    for fd in fds:
        with socket.socket(fileno=os.dup(fd)) as connection:
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
        os.set_blocking(fd, True)
    return len(fds)
