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

Every forward is added once to probe the link (each listener greets), then
taken down, and added back by a process of its own once the rank behind it
listens in the group (``Tunnels.reopen_when_listening``). The decisions
(``plan_links``, ``ring_view``) are plain functions; ``Tunnels`` asks ssh for
the connections and forwards.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import signal
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import anyio
import anyio.abc
import structlog

from neuron.launch.checks import Refused, Unreachable
from neuron.launch.dataplane import join_address, machine_ranks
from neuron.launch.holder import hold_tunnel, release_tunnel
from neuron.launch.hosts import Host
from neuron.launch.launcher import Launcher
from neuron.launch.ssh import ForwardError, StderrRelay, forward_argv, run_forward, spawn_tunnel
from neuron.system.sockets import group_sockets, split_address

log = structlog.get_logger("neuron.launch")

LOOPBACK = "127.0.0.1"
CONNECT_TIMEOUT_S = 15.0
FORWARD_TIMEOUT_S = 10.0
EPHEMERAL = (32768, 60999)  # where a -R's port is picked on the other host (sshd's own pick could not be cancelled)
REMOTE_PORT_TRIES = 5
REOPEN_TRIES = 3000  # looks, 20 ms apart, for the rank behind a link to listen: a minute
# Whether 127.0.0.1:{port} is listening on this host, without connecting (MLX accepts one connection) or binding
# (the port is MLX's): Linux's socket table, else BSD netstat (macOS); waits for it.
LISTENING_CHECK = (
    "n=0; until grep -q ' 0100007F:{hex} 00000000:0000 0A ' /proc/net/tcp 2>/dev/null || "
    "netstat -an -p tcp 2>/dev/null | grep -q '127\\.0\\.0\\.1\\.{port} .*LISTEN'; "
    "do n=$((n+1)); [ $n -lt {tries} ] || exit 1; sleep 0.02; done"
)


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

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self._folder: tempfile.TemporaryDirectory[str] | None = None  # the control sockets', while any is open
        self._connections: dict[str, tuple[Path, anyio.abc.Process, StderrRelay]] = {}
        self._opened: list[tuple[Link, tuple[Forward, ...]]] = []  # each link's forwards, as added
        self._helpers: list[tuple[Link, anyio.abc.Process]] = []
        self._opened_connections = 0
        self._forgotten: list[anyio.abc.Process] = []  # connections that ended by themselves, said lost
        self._holders: list[int] = []  # each connection's holder of rank 0's links (``holder.hold_tunnel``)

    async def open(self, links: list[Link]) -> list[str]:
        """Add every link's forwards; each rank's entry (the address it connects to for its next rank). A port
        taken on the leader, or a host that cannot be reached, is ``Unreachable`` (the leader tries again); an
        sshd that will not forward is ``Refused`` (an operator must allow it)."""
        hosts = [h.ssh for h in self.launcher.hosts]
        entries = []
        for link in links:
            entry, added = link.direct, []
            for step in link.forwards:
                if step.flag == "-R":  # the port on the other host: any free there; one taken is tried again
                    step = replace(step, listen=random.randint(*EPHEMERAL))
                for attempt in range(REMOTE_PORT_TRIES):
                    try:
                        await self._forward(step)
                        break
                    except (ForwardError, TimeoutError) as e:
                        if step.flag == "-L" or attempt == REMOTE_PORT_TRIES - 1:
                            raise forward_failure(step, link, hosts, str(e) or "timed out") from e
                        step = replace(step, listen=random.randint(*EPHEMERAL))
                added.append(step)
                entry = join_address(LOOPBACK, step.listen)
            assert entry is not None
            entries.append(entry)
            self._opened.append((link, tuple(added)))
        tunnelled = [f"{link.rank}->{link.peer}" for link in links if link.forwards]
        log.info("ssh tunnels open", links=tunnelled, connections=len(self._connections))
        return entries

    async def reopen_when_listening(self, listening: list[str]) -> None:
        """Take every forward down, and start, for each link, a process that adds its forwards back once the
        rank behind it listens (``listening``, by rank) on its host.

        Why: through a tunnel, a connect is accepted by ssh at once and closed when nothing listens behind
        it, so MLX (which retries only a refused connect) would keep a dead link. With the entry absent the
        connect is refused, and retried. Each rank's ring listens only inside MLX's init, which holds the GIL,
        so the waiting is done by processes of their own: a look at the host's listening sockets (over the
        tunnel connection for another host), then ``ssh -O forward``."""
        for _, forwards in self._opened:
            for step in reversed(forwards):
                await self._ask(step, "cancel")
        for link, forwards in self._opened:
            if not forwards:
                continue
            port = split_address(listening[link.peer])[1]
            peer = self.launcher.hosts[link.peer]
            wait = ["sh", "-c", LISTENING_CHECK.format(port=port, hex=f"{port:04X}", tries=REOPEN_TRIES)]
            if not peer.local:  # looked at on that host, over the tunnel connection to it
                wait = [*self._mux(peer.ssh), "--", peer.ssh, shlex.join(wait)]
            steps = [shlex.join(wait), *(shlex.join(self._forward_argv(step, "forward")) for step in forwards)]
            helper = await anyio.open_process(
                ["sh", "-c", " && ".join(steps)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a group of its own: ended whole, its ssh with it
            )
            self._helpers.append((link, helper))

    async def settle(self) -> None:
        """Once the group formed (or failed): every helper has finished, or is ended; one that failed is logged."""
        helpers, self._helpers = self._helpers, []
        hosts = [h.ssh for h in self.launcher.hosts]
        for link, helper in helpers:
            if helper.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(helper.pid, signal.SIGKILL)
            await helper.wait()
            said = ""
            if helper.stderr is not None:
                with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError):
                    said = (await helper.stderr.receive()).decode(errors="replace").strip()
            if helper.returncode:
                log.warning(
                    "ssh tunnel not reopened",
                    link=f"{link.rank}->{link.peer}",
                    hosts=[hosts[link.rank], hosts[link.peer]],
                    status=helper.returncode,
                    ssh=said,
                )
            await helper.aclose()

    def hold(self, addresses: list[list[str]]) -> None:
        """Once the group formed over the tunnels: put a holder behind rank 0's links (rank 0's view of the ring,
        ``addresses``) in each connection's ssh, so that a tunnel killed leaves them open, unanswered, for the
        leader to notice and stand in for (``launch.holder``). Where the kernel refuses, the tunnels go on
        unheld, as before, with a warning."""
        ours = group_sockets(addresses, connected=True)
        for host, (_, process, _) in self._connections.items():
            try:
                held = hold_tunnel(process.pid, ours)
            except OSError as e:
                log.warning(
                    "ssh tunnel not held",
                    host=host,
                    reason=str(e),
                    risk="a tunnel killed closes rank 0's links at once, which can leave rank 0 inside the group",
                )
                continue
            if held is not None:
                self._holders.append(held[0])

    def connections(self) -> list[tuple[str, anyio.abc.Process, StderrRelay]]:
        """Each tunnel connection now open: its host, its ssh process, and what ssh said. Its process ending is
        a lost link: every forward on it is gone (ssh's keep-alive ends one whose host stopped answering)."""
        return [(host, process, relay) for host, (_, process, relay) in self._connections.items()]

    def _mux(self, host: str) -> list[str]:
        """ssh through the tunnel connection to ``host``, as a client of its ControlMaster."""
        return [*self.launcher.ssh_command, "-o", "BatchMode=yes", "-S", str(self._connections[host][0])]

    def _forward_argv(self, step: Forward, op: str) -> list[str]:
        host = self.launcher.hosts[step.rank].ssh
        return forward_argv(self.launcher.ssh_command, self._connections[host][0], host, step.flag, step.spec, op)

    async def _forward(self, step: Forward) -> None:
        host = self.launcher.hosts[step.rank].ssh
        if host not in self._connections:
            # A name never used before: a connection killed leaves its control socket behind, and ssh would not
            # listen on it again (every forward asked of it then finds nobody).
            self._opened_connections += 1
            if self._folder is None:
                self._folder = tempfile.TemporaryDirectory(prefix="neuron-tunnels-")
            control = Path(self._folder.name) / f"ssh-{self._opened_connections}"
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
        await self._ask(step, "forward")

    async def _ask(self, step: Forward, op: str) -> None:
        await run_forward(self._forward_argv(step, op), FORWARD_TIMEOUT_S)

    def forget(self, process: anyio.abc.Process) -> bool:
        """Drop the connection ``process`` (it ended by itself, and is said lost where it was noticed), so that
        ``close`` does not name it again; whether it was still open here."""
        for host, (_, open_process, _) in list(self._connections.items()):
            if open_process is process:
                del self._connections[host]
                self._forgotten.append(process)
                return True
        return False

    async def close(self) -> list[tuple[str, anyio.abc.Process, StderrRelay]]:
        """End every tunnel connection (their forwards with them): the ring's links are gone. Returns those that
        had ended by themselves (lost, where nobody has said so yet), as ``connections`` lists them."""
        await self.settle()
        self._opened = []
        for holder in self._holders:
            release_tunnel(holder)
        self._holders = []
        connections, self._connections = self._connections, {}
        listed = [(host, process, relay) for host, (_, process, relay) in connections.items()]
        ended = [(host, process, relay) for host, process, relay in listed if exited(process)]
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
        for process in self._forgotten:
            await process.aclose()
        self._forgotten = []
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
        return ended


def exited(process: anyio.abc.Process) -> bool:
    """Whether ``process`` has ended, reaped or not. asyncio's ``returncode`` lags: its child watcher reaps on a
    thread of its own and reports through the event loop, so a connection killed a moment ago can still read as
    running; ``WNOWAIT`` looks without reaping, leaving the exit status to the watcher. Where Python has no
    ``os.waitid`` (macOS before Python 3.13), asyncio's word alone."""
    if process.returncode is not None or not hasattr(os, "waitid"):
        return process.returncode is not None
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # the watcher reaped it meanwhile
        return True


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
