"""Forming the group: the data plane checked link by link, then every rank joining ``mx.distributed`` at once.

Why check before joining: MLX's ring accepts with no timeout and connects with
retries for about 30 s, so a wrong address or a closed port would show as a
hang inside ``init`` on some rank. Every rank first listens on its host's
addresses (ports free there), then connects to the listeners it will connect
to in the group (``launch.dataplane``); an address that does not answer is
named, with both hosts, before any rank joins.
"""

from __future__ import annotations

import time
from pathlib import Path

import structlog

from neuron import rpc
from neuron.launch.checks import check_probes
from neuron.launch.dataplane import Listeners, backend_setup, probe, probe_targets
from neuron.launch.launcher import Launcher
from neuron.log import configured as log_config
from neuron.log import ms_since
from neuron.pool.fanout import Deadlines, FanOut
from neuron.tp.rank import Rank

log = structlog.get_logger("neuron.pool")


async def form_group(
    fan_out: FanOut, launcher: Launcher, backend: str, pongs: dict[int, rpc.Pong], deadlines: Deadlines, scratch: Path
) -> list[list[str]]:
    """Bring up the group, rank 0 joining concurrently, and check an all-reduce of ones sums to the world size;
    returns every rank's data-plane addresses."""
    started = time.perf_counter()
    world_size, hosts, names = launcher.world_size, launcher.hosts, fan_out.hosts
    listeners = Listeners()
    try:
        addresses = await _open_data_plane(fan_out, launcher, backend, listeners, deadlines.ping)
        level, fmt = log_config()

        def init(rank: int, id: int) -> rpc.Init:
            env, files = backend_setup(backend, rank, addresses, hosts)
            cpus = launcher.cpus(rank, pongs[rank].host.cpus)
            settings = rpc.WorkerSettings(names[rank], level, launcher.log_format(rank, fmt), cpus)
            return rpc.Init(id=id, backend=backend, env=env, files=files, settings=settings)

        def join(rank: Rank) -> float:
            listeners.close()  # MLX binds the same ports next
            env, files = backend_setup(backend, 0, addresses, hosts)
            for variable, content in files.items():
                path = scratch / variable.lower()
                path.write_text(content)
                env[variable] = str(path)
            return rank.init_group(backend, env)

        replies = await fan_out("init", init, join, deadlines.init)
    finally:
        listeners.close()
    sums = {0: replies[0], **{rank: reply.all_sum for rank, reply in replies.items() if rank}}
    wrong = {r: f"sanity all-reduce gave {s:g}, expected {world_size}" for r, s in sums.items() if s != world_size}
    if wrong:
        raise fan_out.break_group("init", wrong)
    log.info("group ready", backend=backend, world_size=world_size, addresses=addresses, ms=ms_since(started))
    return addresses


async def _open_data_plane(
    fan_out: FanOut, launcher: Launcher, backend: str, listeners: Listeners, deadline: float
) -> list[list[str]]:
    """Every rank's ``ip:port`` addresses, each listened on, each reached by the rank that connects to it."""
    hosts = launcher.hosts
    listening = await fan_out(
        "listen",
        lambda rank, id: rpc.Listen(id=id, ips=list(hosts[rank].ips)),
        lambda _: rpc.Listening(id=0, addresses=listeners.open(list(hosts[0].ips))),
        deadline,
    )
    addresses = [listening[rank].addresses for rank in range(launcher.world_size)]
    probed = await fan_out(
        "probe",
        lambda rank, id: rpc.Probe(id=id, addresses=probe_targets(backend, rank, addresses)),
        lambda _: rpc.Probed(id=0, unreachable=probe(probe_targets(backend, 0, addresses))),
        deadline,
    )
    check_probes({r: p.unreachable for r, p in probed.items()}, addresses, fan_out.hosts)
    return addresses
