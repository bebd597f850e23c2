"""What the operating system shows of a process: liveness, TCP sockets, and datagrams sent to a Unix socket (the
systemd notifications and journal entries a server sends)."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Self


class DatagramSink:
    """A Unix datagram socket standing in for systemd's (notify, journal); a thread collects what arrives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.datagrams: list[tuple[float, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.datagrams.append((time.monotonic(), self.sock.recv(1 << 17)))
            except TimeoutError:
                continue

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


class FakeSystemd(DatagramSink):
    """Reads sd_notify datagrams: ``KEY=value`` lines, each stamped with the time it arrived."""

    @property
    def messages(self) -> list[tuple[float, str]]:
        return [(t, line) for t, data in list(self.datagrams) for line in data.decode().splitlines()]

    def seen(self, prefix: str) -> list[float]:
        return [t for t, line in self.messages if line.startswith(prefix)]

    def statuses(self, since: float = 0.0) -> list[str]:
        return [line.removeprefix("STATUS=") for t, line in self.messages if line.startswith("STATUS=") and t > since]


def parse_entry(data: bytes) -> dict[str, str]:
    """One native-protocol datagram: ``KEY=value`` lines, or ``KEY``, a 64-bit length, and a value with newlines."""
    fields: dict[str, str] = {}
    while data:
        end = data.index(b"\n")
        line = data[:end]
        if b"=" in line:
            name, value = line.split(b"=", 1)
            data = data[end + 1 :]
        else:
            (size,) = struct.unpack("<Q", data[end + 1 : end + 9])
            name, value = line, data[end + 9 : end + 9 + size]
            assert data[end + 9 + size : end + 10 + size] == b"\n"
            data = data[end + 10 + size :]
        fields[name.decode()] = value.decode()
    return fields


class Journal(DatagramSink):
    """The journal's socket (``NEURON_JOURNAL_SOCKET``): each datagram read as one entry's fields."""

    def entries(self, **match: str) -> list[dict[str, str]]:
        parsed = [parse_entry(data) for _, data in list(self.datagrams)]
        return [e for e in parsed if all(e.get(k) == v for k, v in match.items())]

    def one(self, **match: str) -> dict[str, str]:
        found = self.entries(**match)
        assert found, f"no journal entry with {match}"
        return found[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now (each held while the next is taken, so no two are the same), for a
    ring's hostfile a test writes."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


TCP_STATES = {"01": "ESTABLISHED", "0A": "LISTEN"}


def tcp_sockets(pid: int) -> list[tuple[str, int, str]]:
    """(local address, local port, state) of every TCP socket the process holds, read from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed since the listing
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # The kernel prints each 32-bit word in host (little-endian) order.
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            out.append((socket.inet_ntop(family, packed), int(port, 16), TCP_STATES.get(fields[3], fields[3])))
    return out
