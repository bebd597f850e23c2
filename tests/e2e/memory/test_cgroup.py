"""The weights each rank needs of a real tiny model, and the words for a worker the OOM killer ended (a real process,
SIGKILLed, its host's OOM count read from a file laid out as the kernel does). The cgroup's room and the check
before loading, decided from files alone: tests/unit/launch/test_cgroup.py."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from neuron import rpc
from neuron.launch import stages
from neuron.pool.link import Link
from testkit.launching import host_info


def test_each_rank_needs_its_share_of_the_layers_and_rank_0_the_rest(tiny_models: dict[str, Path]) -> None:
    from neuron.models.folder import weight_bytes

    model = str(tiny_models["llama"])  # untied: the embedding and the head are the rest
    per_layer, rest = weight_bytes(model, 4)
    assert stages.weights_per_rank(model, 1, []) == [sum(per_layer) + rest]
    assert stages.weights_per_rank(model, 2, []) == [sum(per_layer) // 2 + rest] * 2  # the rest replicated
    assert stages.weights_per_rank(model, 2, [(0, 1), (1, 4)]) == [per_layer[0] + rest, sum(per_layer[1:])]


async def killed_worker(said: rpc.HostInfo | None, counter: Path) -> str:
    """How the leader describes a worker that was SIGKILLed, its host's OOM count in ``counter`` by then."""
    process = await anyio.open_process([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE)
    assert process.stdout is not None
    link = Link(1, "root@mac2", process, BufferedByteReceiveStream(process.stdout), said=said)

    async def read_file(path: str) -> str | None:
        return Path(path).read_text() if Path(path).exists() else None

    link.read_file = read_file
    process.send_signal(signal.SIGKILL)
    try:
        return await link.exit_status()
    finally:
        await process.aclose()


@pytest.mark.anyio
async def test_a_worker_killed_outright_is_named_an_oom_kill_when_its_host_counted_one(tmp_path: Path) -> None:
    counter = tmp_path / "memory.events"
    said = dataclasses.replace(host_info(1 << 30, 512 << 20), oom_counter=str(counter), oom_kills=1)
    counter.write_text("oom 2\noom_kill 2\n")
    oom = await killed_worker(said, counter)
    assert "was killed by the kernel's OOM killer: its memory cgroup reached its limit of 512 MiB" in oom, oom
    assert f"1 OOM kill(s) there since it started, {counter}" in oom and "split the model over more ranks" in oom
    counter.write_text("oom 1\noom_kill 1\n")
    assert (await killed_worker(said, counter)).endswith("was killed by SIGKILL")  # someone else's SIGKILL
    counter.unlink()
    likely = (
        "was killed by SIGKILL (its host's OOM count could not be read: "
        "whether the kernel's OOM killer sent it is unknown)"
    )
    assert (await killed_worker(said, counter)).endswith(likely)
    assert (await killed_worker(None, counter)).endswith(likely)  # died before its handshake
