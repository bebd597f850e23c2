"""The data plane's set-up: which address and port each rank's collectives use, checked before MLX uses them.

MLX's ring backend has rank r accept one connection per address of its own
hostfile entry (bound to that address, never 0.0.0.0) and connect to rank
r+1's. Its accept has no timeout and its connect retries for about 30 s, so a
wrong address or a closed firewall shows up as a hang. So each rank first
listens on its own addresses, on ports free on its own host (``Listeners``),
then connects to the next rank's as the ring will (``probe``); only once every
link answered are the listeners closed, all of them, and the ranks join the
group (a ring connect that comes early is refused, and MLX tries again). A
listener greets each connection with one byte, and a probe passes only once
that byte arrives: through an SSH tunnel (``tunnels.py``) the connect itself
is answered by ssh on the prober's own host, whatever lies beyond. The prober
closes first, so the listener's port is left with no TIME_WAIT (MLX binds it
next, with ``SO_REUSEADDR`` besides). No MLX here: rank 0's part runs in the
leader.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading

from neuron.launch.hosts import Host
from neuron.system.sockets import group_sockets, split_address

PROBE_TIMEOUT_S = 3.0
GREETING = b"\x01"
# How soon a greeter notices its listener closing where shutting the listener down does not wake its accept (a close
# never does; on Linux a shutdown does, at once).
_ACCEPT_POLL_S = 0.1


def join_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class Listeners:
    """A listening socket on each of this host's data-plane addresses, each on a port free there, each greeting the
    connections it gets (``GREETING``) on a thread of its own until closed."""

    def __init__(self) -> None:
        self._sockets: list[socket.socket] = []
        self._greeters: list[threading.Thread] = []
        self._closing = threading.Event()

    def open(self, ips: list[str]) -> list[str]:
        """Listen on each of ``ips``; returns their ``ip:port`` addresses. Raises ``OSError`` naming an address
        this host does not have."""
        self.close()
        self._closing = threading.Event()
        for ip in ips:
            family = socket.AF_INET6 if ":" in ip else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((ip, 0))
            except OSError as e:
                sock.close()
                self.close()
                raise OSError(e.errno, f"cannot listen on {ip}: {e.strerror} (is it an address of this host?)") from e
            sock.listen(8)
            sock.settimeout(_ACCEPT_POLL_S)
            self._sockets.append(sock)
            greeter = threading.Thread(target=self._greet, args=(sock, self._closing), daemon=True)
            greeter.name = f"neuron-greeter-{ip}"
            greeter.start()
            self._greeters.append(greeter)
        return [join_address(ip, s.getsockname()[1]) for ip, s in zip(ips, self._sockets, strict=True)]

    @staticmethod
    def _greet(sock: socket.socket, closing: threading.Event) -> None:
        while not closing.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(PROBE_TIMEOUT_S)
                try:
                    conn.sendall(GREETING)
                    conn.recv(1)  # until the prober closes: its side, not this port, keeps the TIME_WAIT
                except OSError:
                    pass

    def close(self) -> None:
        self._closing.set()
        for sock in self._sockets:
            with contextlib.suppress(OSError):  # not listening any more, or a system where it cannot wake it
                sock.shutdown(socket.SHUT_RDWR)  # wakes its greeter's accept: every group formed waited a poll
        for greeter in self._greeters:
            greeter.join(timeout=PROBE_TIMEOUT_S)
        for sock in self._sockets:
            sock.close()
        self._sockets, self._greeters = [], []


def probe(addresses: list[str], timeout: float = PROBE_TIMEOUT_S) -> dict[str, str]:
    """Connect to each address as the ring will and wait for its listener's greeting; returns the unreachable
    ones, each with the reason."""
    unreachable = {}
    for address in addresses:
        ip, port = split_address(address)
        try:
            sock = socket.create_connection((ip, port), timeout=timeout)
        except TimeoutError:
            unreachable[address] = f"no answer within {timeout:g} s (a link down, or a firewall dropping it?)"
            continue
        except OSError as e:
            unreachable[address] = e.strerror or str(e)
            continue
        with sock:
            try:
                answer = sock.recv(1)
            except TimeoutError:
                unreachable[address] = f"connected, but no listener answered within {timeout:g} s"
                continue
            except OSError as e:
                unreachable[address] = e.strerror or str(e)
                continue
            if answer != GREETING:
                unreachable[address] = "connected, but closed before any listener answered (a tunnel to nothing?)"
    return unreachable


def cut(addresses: list[list[str]]) -> int:
    """Shut down every socket of this process bound to or connected to one of a group's ``addresses``; returns
    how many. Why: rank 0's thread may sit inside a collective for a peer that is stopped or out of reach, which
    no timeout of MLX ends; a socket shut down under it makes the collective fail. The descriptors stay MLX's (it
    closes them with the group): only the connections end."""
    count = 0
    for fd in group_sockets(addresses):
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
    return count


class Sink:
    """Stands in for a lost group's peers on this process's ends of its connections: every byte sent is read and
    dropped, and zeros are there to receive, so that every collective rank 0 has queued on the group completes
    (with meaningless values, never read: the group is being left) and its thread comes out.

    Why not only ``cut``: MLX's ring gives each socket a thread that, once transfers on it fail, fails those
    pending and ends; a collective queued after that (the rest of a step already built) waits on a socket no
    thread serves, forever, and with it the thread, and MLX's scheduler, which counts its queued work, for every
    other thread of the process. A peer that is stopped or out of reach fails nothing by itself; here it never
    fails at all. Each descriptor is replaced in place (``dup2``) by one end of a local socket pair, non-blocking
    as the ring's were; the pairs end when MLX closes the descriptors with the group, or with ``close``."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._ends: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    def replace(self, addresses: list[list[str]]) -> int:
        """Put the sink under every socket of this process on the group's ``addresses``; returns how many."""
        count = 0
        for fd in group_sockets(addresses, connected=True):
            mine, theirs = socket.socketpair()
            mine.setblocking(False)
            theirs.setblocking(False)
            try:
                os.dup2(theirs.fileno(), fd)
            except OSError:
                mine.close()
                continue
            finally:
                theirs.close()
            self._ends.append(mine)
            thread = threading.Thread(target=self._serve, args=(mine,), name="neuron-sink", daemon=True)
            thread.start()
            self._threads.append(thread)
            count += 1
        return count

    def _serve(self, end: socket.socket) -> None:
        zeros = bytes(1 << 16)
        while not self._stop.is_set():
            try:
                readable, writable, _ = select.select([end], [end], [], _ACCEPT_POLL_S)
                if readable and not end.recv(1 << 16):
                    return  # MLX closed its end with the group
                if writable:
                    end.send(zeros)
            except BlockingIOError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=1.0)
        for end in self._ends:
            end.close()
        self._ends, self._threads = [], []


def ring_files(addresses: list[list[str]]) -> dict[str, str]:
    """The ring's hostfile: each rank's ``ip:port`` addresses, in rank order, as one rank sees them (the same
    for every rank on the direct data plane; through tunnels, ``tunnels.ring_view``)."""
    return {"MLX_HOSTFILE": json.dumps(addresses)}


def probe_targets(backend: str, rank: int, addresses: list[list[str]]) -> list[str]:
    """Where ``rank`` connects when the group forms (``addresses`` as it sees them): the ring's next rank, or the
    coordinator on rank 0."""
    if backend == "ring":
        return addresses[(rank + 1) % len(addresses)] if len(addresses) > 1 else []
    return [addresses[0][0]] if rank else []


def probe_peer(backend: str, rank: int, world_size: int) -> int:
    """The rank whose listener ``rank`` probes (``probe_targets``)."""
    return (rank + 1) % world_size if backend == "ring" else 0


def backend_setup(backend: str, rank: int, addresses: list[list[str]], hosts: list[Host]) -> tuple[dict, dict]:
    """The variables (and files named by variables) ``mx.distributed.init`` reads on ``rank``, as ``mlx.launch``
    sets them (``addresses`` as ``rank`` sees them): the ring's hostfile; jaccl's coordinator (rank 0's first
    address) and RDMA device matrix; nccl's rendezvous on rank 0 (each rank's GPU is chosen earlier, when it is
    spawned: ``spawn_env``)."""
    env = {"MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(len(hosts))}
    if backend == "ring":
        return env, ring_files(addresses)
    coordinator = addresses[0][0]
    if backend == "jaccl":
        return {**env, "MLX_JACCL_COORDINATOR": coordinator}, {"MLX_IBV_DEVICES": json.dumps([h.rdma for h in hosts])}
    ip, port = split_address(coordinator)
    return {**env, "NCCL_HOST_IP": ip, "NCCL_PORT": str(port)}, {}


def machine_ranks(hosts: list[Host], rank: int) -> list[int]:
    """The ranks placed on the machine ``rank`` runs on, in rank order (every local name is this machine)."""
    host = hosts[rank]
    return [r for r, h in enumerate(hosts) if h.ssh == host.ssh or (h.local and host.local)]


def visible_gpus(value: str | None) -> list[str] | None:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value lets a process use, in order; None when it is unset."""
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def spawn_env(backend: str, rank: int, hosts: list[Host], leader_visible: str | None) -> dict[str, str]:
    """What ``rank``'s process must find in its environment when it starts, before anything in it initialises
    CUDA (later is too late: CUDA reads ``CUDA_VISIBLE_DEVICES`` once): with nccl, the one GPU it may use, the
    i-th of its machine for its machine's i-th rank. On the leader's machine the i-th is counted among those the
    leader's own ``CUDA_VISIBLE_DEVICES`` allows, where it sets one (rank 0, in the leader, uses the first);
    MLX's nccl then takes the one device the rank sees. Whether the machine has that many GPUs is checked from
    the handshake (``checks.check_gpus``) before anything loads."""
    if backend != "nccl":
        return {}
    index = machine_ranks(hosts, rank).index(rank)
    allowed = visible_gpus(leader_visible) if hosts[rank].local else None
    return {"CUDA_VISIBLE_DEVICES": allowed[index] if allowed and index < len(allowed) else str(index)}
