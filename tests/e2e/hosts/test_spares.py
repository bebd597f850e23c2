"""Spares across namespaces with real sshd (testkit/testbed.py): a rank whose host dies for good moves to the
hostfile's spare once it has been out of reach for ``--spare-timeout``, and a host the operator drains gives its rank
to a spare it just added; each time the group re-forms there, every stream in flight ends with the text of an
undisturbed run, and the leader never restarts and says which rank moved where and why.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit import Server, alive, resume, run_neuron, serving, wait_until
from testkit.testbed import Namespaces, started, unavailable

pytestmark = [pytest.mark.hosts, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

SPARE_S = 4  # short, so the test is; well under --resume-timeout
RESUMING = resume.shorter(120)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaces]:
    with started(2, tmp_path_factory.mktemp("testbed")) as testbed:
        yield testbed


@pytest.fixture
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


def test_a_host_added_then_a_working_host_drained_and_every_stream_goes_on(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``neuron hosts add`` brings in a spare; ``neuron hosts drain`` moves the working host's rank to it at a step
    boundary while streams run, stops its worker, and leaves it out of the hostfile."""
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(0)], "drain.json")
    working, added = f"root@{bed.ip(0)}", f"root@{bed.ip(1)}"
    args = ("--model", str(tiny_models["qwen3"]), "--hosts", str(hostfile), "--ssh-command", bed.ssh_command)
    # No loss may be blamed on any request: with --resume-tries 0, a drain that counted one would end them all.
    with serving(tmp_path_factory, *args, "--resume-tries", "0") as server:

        def hosts(*words: str) -> subprocess.CompletedProcess[str]:
            return run_neuron("hosts", *words, "--url", server.url, timeout=300)

        spare = bed.entry(1)
        added_now = hosts("add", added, "--ip", bed.ip(1), "--neuron", spare["neuron"], "--cpus", "1")
        assert added_now.returncode == 0, added_now.stderr
        refused = hosts("drain", "localhost")
        assert refused.returncode == 1 and "is the leader's own host" in refused.stderr, refused.stderr
        undisturbed = resume.references(server.url, RESUMING)
        (old,) = bed.workers(0)
        drained: list[subprocess.CompletedProcess[str]] = []
        resume.disturb(server, undisturbed, lambda: drained.append(hosts("drain", working)), bases=RESUMING)
        assert drained[0].returncode == 0 and f"drained {working}: rank 1 moved to {added}" in drained[0].stdout
        wait_until(lambda: not alive(old), 15, "the drained host's worker to be stopped")
        assert bed.workers(1) and not bed.workers(0)
        no_spare = hosts("drain", added)
        assert no_spare.returncode == 1 and "0 spare(s) stand by" in no_spare.stderr, no_spare.stderr
        metrics = server.metrics()
        assert metrics[("neuron_rank_moves_total", (("cause", "drained"),))] == 1
        assert server.find_log("restarting") is None
        assert not [e for e in server.logs() if e.get("event") == "not resumed"]
    written = json.loads(hostfile.read_text())
    assert [h["ssh"] for h in written["hosts"]] == ["localhost", added] and written["spares"] == []
