"""Forming the group: the data plane checked link by link, then every rank joining ``mx.distributed`` at once.

Why check before joining: MLX's ring accepts with no timeout and connects with
retries for about 30 s, so a wrong address or a closed port would show as a
hang inside ``init`` on some rank. Every rank first listens on its host's
addresses (ports free there), then connects to the listeners it will connect
to in the group (``launch.dataplane``); an address that does not answer is
named, with both hosts, before any rank joins. With ``--data-plane ssh``
every rank listens on its host's loopback instead, the links between hosts
are SSH tunnels (``launch.tunnels``), each rank gets a hostfile of its own,
the probes go through the tunnels as the ring will, and each tunnel is
opened again for the group only once the rank behind it listens.
"""

from __future__ import annotations

import socket
import time

import structlog

from neuron import rpc
from neuron.launch.checks import check_probes
from neuron.launch.dataplane import Listeners, backend_setup, probe, probe_targets
from neuron.launch.launcher import Launcher
from neuron.launch.tunnels import LOOPBACK, Tunnels, plan_links, ring_view
from neuron.log import configured as log_config
from neuron.log import ms_since
from neuron.pool.fanout import Deadlines, FanOut
from neuron.rank.rank import Rank

log = structlog.get_logger("neuron.pool")


async def form_group(
    fan_out: FanOut,
    launcher: Launcher,
    backend: str,
    pongs: dict[int, rpc.Pong],
    deadlines: Deadlines,
    tunnels: Tunnels,
) -> list[list[str]]:
    """Bring up the group, rank 0 joining concurrently, and check an all-reduce of ones sums to the world size;
    returns every rank's data-plane addresses as rank 0 reaches them (its end of the connections)."""
    started = time.perf_counter()
    world_size, hosts, names = launcher.world_size, launcher.hosts, fan_out.hosts
    listeners = Listeners()
    try:
        views = await _open_data_plane(fan_out, launcher, backend, listeners, tunnels, deadlines.ping)
        level, fmt = log_config()

        def init(rank: int, id: int) -> rpc.Init:
            env, files = backend_setup(backend, rank, views[rank], hosts)
            cpus = launcher.cpus(rank, pongs[rank].host.cpus)
            settings = rpc.WorkerSettings(names[rank], level, launcher.log_format(rank, fmt), cpus)
            return rpc.Init(id=id, backend=backend, env=env, files=files, settings=settings)

        def join(rank: Rank) -> float:
            return rank.init_group(backend, *backend_setup(backend, 0, views[0], hosts))

        replies = await fan_out("init", init, join, deadlines.init)
    finally:
        listeners.close()
        await tunnels.settle()
    sums = {0: replies[0], **{rank: reply.all_sum for rank, reply in replies.items() if rank}}
    wrong = {r: f"sanity all-reduce gave {s:g}, expected {world_size}" for r, s in sums.items() if s != world_size}
    if wrong:
        raise fan_out.break_group("init", wrong)
    if launcher.tunnelled:
        tunnels.hold(views[0])
    log.info(
        "group ready",
        backend=backend,
        world_size=world_size,
        data_plane=launcher.data_plane,
        addresses=views[0],
        ms=ms_since(started),
    )
    return views[0]


async def _open_data_plane(
    fan_out: FanOut, launcher: Launcher, backend: str, listeners: Listeners, tunnels: Tunnels, deadline: float
) -> list[list[list[str]]]:
    """Each rank's view of every rank's ``ip:port`` addresses (its hostfile), each listened on, each reached
    by the rank that connects to it: directly, or through the SSH tunnels from its own host."""
    hosts, world_size = launcher.hosts, launcher.world_size
    tunnelled = launcher.tunnelled

    def ips(rank: int) -> list[str]:
        return [LOOPBACK] if tunnelled else list(hosts[rank].ips)

    listening = await fan_out(
        "listen",
        lambda rank, id: rpc.Listen(id=id, ips=ips(rank)),
        lambda _: rpc.Listening(id=0, addresses=listeners.open(ips(0))),
        deadline,
    )
    addresses = [listening[rank].addresses for rank in range(world_size)]
    if tunnelled:
        links = plan_links(hosts, [a[0] for a in addresses], _free_loopback_port)
        entries = await tunnels.open(links)
        views = [ring_view(rank, [a[0] for a in addresses], entries) for rank in range(world_size)]
    else:
        views = [addresses] * world_size
    probed = await fan_out(
        "probe",
        lambda rank, id: rpc.Probe(id=id, addresses=probe_targets(backend, rank, views[rank])),
        lambda _: rpc.Probed(id=0, unreachable=probe(probe_targets(backend, 0, views[0]))),
        deadline,
    )
    check_probes({r: p.unreachable for r, p in probed.items()}, backend, fan_out.hosts, tunnelled)
    # Closed everywhere before any rank joins: a ring connect that came early would be greeted by a listener
    # of the probe's and kept, where now it is refused, and MLX tries again. And each tunnel comes back only
    # once the rank behind it listens in the group (``Tunnels``), which must not find a probe's listener.
    await fan_out("listen", lambda rank, id: rpc.Listen(id=id, ips=[]), lambda _: listeners.close(), deadline)
    if tunnelled:
        await tunnels.reopen_when_listening([a[0] for a in addresses])
    return views


def _free_loopback_port() -> int:
    """A port free on this host's loopback now, for a tunnel's ``-L`` (taken before ssh listens: ``open_links``
    says so, and the leader tries again)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])
