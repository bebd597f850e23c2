"""Spares across namespaces with real sshd (testkit/testbed.py): a rank whose host dies for good moves to the
hostfile's spare once it has been out of reach for ``--spare-timeout``, the group re-forms there, and every stream in
flight ends with the text of an undisturbed run; the leader never restarts, and says which rank moved where and why.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit import Server, resume, serving, wait_until
from testkit.testbed import Namespaces, started, unavailable

pytestmark = [pytest.mark.hosts, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

SPARE_S = 4  # short, so the test is; well under --resume-timeout
RESUMING = resume.shorter(120)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaces]:
    with started(2, tmp_path_factory.mktemp("testbed")) as testbed:
        yield testbed


@pytest.fixture(scope="module")
def with_a_spare(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """Rank 1 on host 0, host 1 a spare; a short step deadline, so a silent host is noticed within seconds."""
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(0)], "spares.json", spares=[bed.entry(1)])
    args = (
        *("--model", str(tiny_models["qwen3"]), "--hosts", str(hostfile), "--ssh-command", bed.ssh_command),
        *("--step-timeout", "3", "--spare-timeout", str(SPARE_S), "--resume-timeout", "90"),
    )
    with serving(tmp_path_factory, *args) as server:
        yield server
    wait_until(lambda: not bed.workers(0) and not bed.workers(1), 10, "no neuron worker left on either host")


def test_a_host_gone_for_good_gives_its_rank_to_the_spare_and_every_stream_goes_on(
    bed: Namespaces, with_a_spare: Server
) -> None:
    server = with_a_spare
    lost, spare = f"root@{bed.ip(0)}", f"root@{bed.ip(1)}"
    undisturbed = resume.references(server.url, RESUMING)
    assert not bed.workers(1)  # the spare stands by with nothing running
    try:
        resume.disturb(server, undisturbed, lambda: bed.gone_for_good(0), bases=RESUMING)
    finally:
        bed.back(0)
    moved = server.find_log("rank moved to a spare")
    assert moved is not None and (moved["rank"], moved["host"], moved["spare"]) == (1, lost, spare), moved
    assert moved["out_s"] >= SPARE_S and "--spare-timeout" in moved["reason"]
    assert server.find_log("restarting") is None  # the leader never restarted
    assert bed.workers(1)  # rank 1 runs on the spare now
    status = httpx.get(f"{server.url}/v1/status", timeout=10).json()
    assert [r["host"] for r in status["ranks"]] == ["localhost", spare]
    assert status["spares"] == [{"host": lost, "state": "returning"}]  # a spare again, tried after any other
    (move,) = status["moves"]
    assert (move["rank"], move["from"], move["to"]) == (1, lost, spare) and "--spare-timeout" in move["reason"]
    assert any(e["event"] == "moved" and e["ranks"] == [1] for e in status["events"]), status["events"]
    metrics = server.metrics()
    assert metrics[("neuron_rank_moves_total", (("cause", "unreachable"),))] == 1
    assert metrics[("neuron_rank_info", (("host", spare), ("rank", "1")))] == 1
    assert ("neuron_rank_info", (("host", lost), ("rank", "1"))) not in metrics
