"""``--data-plane ssh``: the ring's links between hosts carried by port forwards on the leader's SSH connections.

MLX's ring has rank r accept on its own hostfile entry and connect to entry
r+1; no other entry is read. So each rank's listener binds 127.0.0.1 on its
own host (the one address this data plane names), and each rank is given a
hostfile of its own (``ring_view``) in which entry r+1 is where it reaches
rank r+1 from its host: that rank's listener when both share a machine (no
tunnel), else the local end of a tunnel. The tunnels are forwards added to
a connection of their own to each host that carries one (a ControlMaster,
``ssh.py``), so they cross the network inside SSH; the pool closes them with
the group, and a leader that dies closes their sessions' stdin, which ends
them:

- rank r on the leader's machine, r+1 on host H: ``-L`` on the connection to
  H: a listener on the leader's 127.0.0.1, reaching r+1's.
- rank r on host H, r+1 on the leader's machine: ``-R`` on the connection to
  H: sshd on H listens on its 127.0.0.1 (port picked by sshd) and the
  leader's ssh connects to r+1's listener.
- r on H, r+1 on another host G: both, relayed through the leader's host
  (the leader holds the only credentials): ``-L`` on the connection to G,
  then ``-R`` on the connection to H, to that ``-L``'s port.

The decisions (``plan_links``, ``ring_view``) are plain functions; ``Tunnels``
asks ssh for the connections and forwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import structlog

from neuron.launch.checks import Refused, Unreachable
from neuron.launch.dataplane import RING_GATE_ENV, RING_REPORT_ENV, join_address, machine_ranks
from neuron.launch.hosts import Host
from neuron.launch.launcher import Launcher
from neuron.launch.ssh import ForwardError, StderrRelay, forward, spawn_tunnel

log = structlog.get_logger("neuron.launch")

LOOPBACK = "127.0.0.1"
CONNECT_TIMEOUT_S = 15.0
FORWARD_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Forward:
    """One port forward on the tunnel connection to ``rank``'s host: ``-L`` listens on the leader's host, ``-R``
    on that host (port 0: sshd picks one); both on loopback, to ``target`` on the other side's loopback."""

    rank: int
    flag: str
    listen: int
    target: str

    @property
    def spec(self) -> str:
        return f"{LOOPBACK}:{self.listen}:{self.target}"


@dataclass(frozen=True, slots=True)
class Link:
    """Rank ``rank``'s connection to rank ``peer``: ``direct`` (the peer's listener, on the same machine) or the
    tunnel whose last forward's listening port is ``rank``'s entry."""

    rank: int
    peer: int
    direct: str | None
    forwards: tuple[Forward, ...] = ()


def plan_links(hosts: list[Host], listening: list[str], free_port: Callable[[], int]) -> list[Link]:
    """Each rank's link to the next, from each rank's listener (``127.0.0.1:port`` on its own host);
    ``free_port`` gives a port free on the leader's loopback for each ``-L``."""
    world_size = len(hosts)
    if world_size < 2:
        return []
    links = []
    for rank in range(world_size):
        peer = (rank + 1) % world_size
        if peer in machine_ranks(hosts, rank):
            links.append(Link(rank, peer, listening[peer]))
            continue
        forwards: list[Forward] = []
        target = listening[peer]
        if not hosts[peer].local:  # reach the peer's host from the leader's
            forwards.append(Forward(peer, "-L", free_port(), target))
            target = join_address(LOOPBACK, forwards[-1].listen)
        if not hosts[rank].local:  # reach the leader's host (the peer, or the -L above) from this rank's
            forwards.append(Forward(rank, "-R", 0, target))
        links.append(Link(rank, peer, None, tuple(forwards)))
    return links


def ring_view(rank: int, listening: list[str], entries: list[str]) -> list[list[str]]:
    """``rank``'s ring hostfile: every rank's listener, but its next rank's entry replaced by where ``rank``
    reaches it (``entries[rank]``). MLX reads only entries ``rank`` (to accept) and ``rank + 1`` (to connect)."""
    view = [[address] for address in listening]
    view[(rank + 1) % len(listening)] = [entries[rank]]
    return view


class Tunnels:
    """One group's tunnel connections, one per host that carries a forward, opened as the links need them."""

    def __init__(self, launcher: Launcher, scratch: Path) -> None:
        self.launcher = launcher
        self.scratch = scratch  # the control sockets' folder (the pool's, removed with it)
        self._connections: dict[str, tuple[Path, anyio.abc.Process, StderrRelay]] = {}

    async def open(self, links: list[Link]) -> list[str]:
        """Add every link's forwards; each rank's entry (the address it connects to for its next rank). A port
        taken on the leader between picking and listening, or a host that cannot be reached, is ``Unreachable``
        (the leader tries again); an sshd that will not forward is ``Refused`` (an operator must allow it)."""
        hosts = [h.ssh for h in self.launcher.hosts]
        entries = []
        for link in links:
            entry = link.direct
            for step in link.forwards:
                try:
                    port = await self._forward(step)
                except (ForwardError, TimeoutError) as e:
                    raise forward_failure(step, link, hosts, str(e) or "timed out: no answer from ssh") from e
                entry = join_address(LOOPBACK, port)
            assert entry is not None
            entries.append(entry)
        tunnelled = [f"{link.rank}->{link.peer}" for link in links if link.forwards]
        log.info("ssh tunnels open", links=tunnelled, connections=len(self._connections))
        return entries

    async def _forward(self, step: Forward) -> int:
        host = self.launcher.hosts[step.rank].ssh
        if host not in self._connections:
            control = self.scratch / f"ssh-{len(self._connections)}"
            try:
                with anyio.fail_after(CONNECT_TIMEOUT_S):
                    process, relay = await spawn_tunnel(self.launcher.ssh_command, host, control, step.rank)
            except (ForwardError, TimeoutError) as e:
                raise Unreachable(
                    f"cannot open the SSH connection for the data plane's tunnels to {host} (ssh: "
                    f"{str(e) or f'no session within {CONNECT_TIMEOUT_S:g} s'}); the leader tries again",
                    [host],
                ) from e
            self._connections[host] = (control, process, relay)
        control = self._connections[host][0]
        return await forward(self.launcher.ssh_command, control, host, step.flag, step.spec, FORWARD_TIMEOUT_S)

    def ring_env(self, rank: int) -> dict[str, str]:
        """What ``rank``'s init adds to its environment for the order of joining (``join_in_order``): the last
        rank waits for the leader's word, the ranks between say when they join (on stderr, which the leader reads
        from another host; in a file of the pool's on this one)."""
        hosts, last = self.launcher.hosts, self.launcher.world_size - 1
        if rank == last:
            return {RING_GATE_ENV: "1"}
        if rank == 0:
            return {}
        return {RING_REPORT_ENV: str(self.scratch / f"joining-{rank}") if hosts[rank].local else "-"}

    def join_in_order(self, release: Callable[[], None], timeout: float) -> None:
        """On rank 0's thread, just before it joins: wait until every rank but 0 and the last said it joins, then
        ``release`` the last.

        Why: in MLX's ring the last rank connects first (to rank 0) and every other rank listens first and
        connects once connected to; so once ranks 0 to n-2 listen, each connect finds its listener, and the
        last listens as soon as its own connect returns. Through a tunnel a connect that finds no listener is
        accepted by ssh and then closed, and MLX's retries never run. MLX listens first thing in its init, but
        holds the GIL throughout, so the word comes just before it: each listens a few system calls after its
        word, and the connect that needs it is at least a round trip over SSH later."""
        hosts = self.launcher.hosts
        deadline = time.monotonic() + timeout
        for rank in range(1, len(hosts) - 1):
            if hosts[rank].local:
                while not (self.scratch / f"joining-{rank}").exists() and time.monotonic() < deadline:
                    time.sleep(0.005)
            elif relay := self.launcher.relays.get(rank):
                relay.ring_joining.wait(max(0.0, deadline - time.monotonic()))
        release()  # past the deadline too: the group's own deadline then names who is stuck

    async def close(self) -> None:
        """End every tunnel connection (their forwards with them): the ring's links are gone."""
        connections, self._connections = self._connections, {}
        for _, process, _ in connections.values():
            if process.returncode is None:
                process.terminate()  # closing stdin is not enough: ssh waits for its forwarded connections
        for _, process, _ in connections.values():
            with anyio.move_on_after(5.0):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            await process.aclose()


def forward_failure(forward: Forward, link: Link, hosts: list[str], said: str) -> Exception:
    """The error for a forward ssh could not add, by what it means: a port taken or a connection lost (tried
    again), or an sshd that will not forward (an operator must allow it)."""
    where = f"the SSH tunnel from rank {link.rank} on {hosts[link.rank]} to rank {link.peer} on {hosts[link.peer]}"
    carrier = hosts[forward.rank]
    lost = any(words in said.lower() for words in ("control socket", "timed out"))
    if forward.flag == "-R" and not lost:
        return Refused(
            f"{where}: sshd on {carrier} would not listen on its {LOOPBACK} for it (ssh: {said}); allow remote "
            "forwarding in that host's sshd_config (AllowTcpForwarding yes or remote, the default), or use "
            "--data-plane direct on a private link"
        )
    listening = f"the leader's {LOOPBACK}:{forward.listen}" if forward.flag == "-L" else f"{LOOPBACK} on {carrier}"
    return Unreachable(
        f"{where}: cannot listen on {listening} through {carrier}'s SSH connection (ssh: {said}); a port another "
        "process took, or the connection lost: trying again",
        [carrier],
    )
