"""A spare asked who it is before it is added (``neuron hosts add``): a worker started there as rank 1 of 2, pinged,
asked for the model where the leader could not send it, and stopped. No MLX here, none on the spare (a worker
imports MLX only to load).

Why before, not when a rank needs it: a spare found unfit only when a host is
lost costs the streams in flight another ``--spare-timeout``; found now, the
operator is told at once what to fix, and nothing serving is touched (the probe
runs beside the group, which it never joins).
"""

from __future__ import annotations

import os
import shlex

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream

from neuron import rpc
from neuron.launch.checks import Refused, check_handshake, model_differences, size
from neuron.launch.dataplane import spawn_env
from neuron.launch.hosts import Host, HostsError, describe_host
from neuron.launch.launcher import Launcher
from neuron.models import hub
from neuron.models.folder import digest_files
from neuron.pool.link import Link
from neuron.pool.ranks import Ranks


class SpareUnfit(HostsError):
    """A spare that cannot take a rank's place: out of reach, other versions, too little memory. 422."""

    status = 422


async def probe_spare(ranks: Ranks, spare: Host, need: int, model_path: str) -> rpc.HostInfo:
    """What ``spare`` says of itself, once it is known to answer as a worker would, to run the leader's versions,
    to have ``need`` bytes (the largest rank's share of the weights) available, and to hold the leader's model
    (``model_path``) where the leader could not send it its share; ``SpareUnfit`` saying which and what to do
    otherwise."""
    launcher = ranks.launcher
    trial = Launcher([launcher.hosts[0], spare], shlex.join(launcher.ssh_command), launcher.data_plane)
    env = spawn_env(ranks.backend, 1, trial.hosts, os.environ.get("CUDA_VISIBLE_DEVICES"))
    env.update(hub.host_env(ranks.model, ranks.layout.push))
    deadlines = ranks.deadlines
    try:
        spawned = await trial.spawn(1, env)
    except OSError as e:
        raise SpareUnfit(f"cannot start a worker on the spare {spare.ssh}: {e}") from None
    assert spawned.process.stdout is not None
    link = Link(1, spare.ssh, spawned.process, BufferedByteReceiveStream(spawned.process.stdout), spawned.last_words)
    try:
        try:
            request = await link.send(rpc.Ping(id=link.take_id()), deadlines.ping)
            pong = await link.receive(request, deadlines.ping)
        except Exception as e:  # noqa: BLE001 - any way it fails, the spare cannot serve: say how
            with anyio.move_on_after(2.0):
                await spawned.process.wait()
            said = spawned.last_words()
            why = _what(e)
            raise SpareUnfit(
                f"cannot reach the spare {spare.ssh} as a worker ({why}{f'; it said: {said}' if said else ''}): "
                "check that `ssh` reaches it by key with the leader's --ssh-command, and that its 'neuron' command "
                "starts neuron"
            ) from None
        info = _fit(pong, spare, launcher.hosts[0].ssh, need)
        if not hub.leader_may_push(ranks.model, ranks.layout.push):
            await _holds_the_model(link, trial.model(1, ranks.model, model_path), model_path, spare, deadlines.load)
        return info
    finally:
        with anyio.CancelScope(shield=True):
            await link.stop(deadlines.shutdown, broken=False)


def _fit(pong: rpc.Reply, spare: Host, leader: str, need: int) -> rpc.HostInfo:
    """What the spare said of itself, once its versions and its memory are known to serve."""
    if not isinstance(pong, rpc.Pong):
        raise SpareUnfit(f"the spare {spare.ssh} answered the leader's ping with an error: {pong}")
    try:
        check_handshake({1: pong}, describe_host(0), 2, [leader, spare.ssh])
    except Refused as e:
        raise SpareUnfit(str(e).replace(f"rank 1 on {spare.ssh}", f"the spare {spare.ssh}")) from None
    info = pong.host
    if need > info.free_memory:
        raise SpareUnfit(
            f"the spare {spare.ssh} ({info.hostname}) has {size(info.free_memory)} available, but a rank's share of "
            f"the model's weights takes up to {size(need)}: give it more memory, or choose another spare"
        )
    return info


async def _holds_the_model(link: Link, model: str | None, model_path: str, spare: Host, deadline: float) -> None:
    """The spare holds the leader's model, file for file, where the leader could not send it a share (a folder
    without ``--push-model``): a spare that lacks it would fail only when a host is lost, and the streams wait."""
    try:
        request = await link.send(rpc.CheckModel(id=link.take_id(), model=model), deadline)
        reply = await link.receive(request, deadline)
    except Exception as e:  # noqa: BLE001 - any way it fails, the spare cannot be trusted with a rank
        why = _what(e)
        raise SpareUnfit(f"the spare {spare.ssh} did not say whether it holds the model ({why})") from None
    if isinstance(reply, rpc.Error):
        raise SpareUnfit(f"the spare {spare.ssh} cannot load the model: {reply.message}")
    assert isinstance(reply, rpc.ModelChecked)
    mine = rpc.ModelChecked(id=0, path=model_path, files=digest_files(model_path))
    if (differs := model_differences({0: mine, 1: reply}, ["the leader", spare.ssh]).get(1)) is not None:
        raise SpareUnfit(
            differs.replace(f"rank 1 on {spare.ssh}", f"the spare {spare.ssh}")
            + "; copy the leader's model folder there (or name its path with --model), or start the leader with "
            "--push-model to have it send the spare its share"
        )


def _what(error: Exception) -> str:
    """How a failed exchange with the spare's worker failed, in words: its kind, and its message where it has one."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
