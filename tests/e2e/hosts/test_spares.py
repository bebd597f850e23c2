"""Spares across namespaces with real sshd (testkit/testbed.py): a rank whose host dies for good moves to the
hostfile's spare once it has been out of reach for ``--spare-timeout``, and a host the operator drains gives its rank
to a spare it just added; each time the group re-forms there, every stream in flight ends with the text of an
undisturbed run, and the leader never restarts and says which rank moved where and why.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from testkit import Server, alive, resume, run_neuron, serving, wait_until
from testkit.testbed import Namespaces, started, unavailable

pytestmark = [pytest.mark.hosts, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

SPARE_S = 4  # short, so the test is; well under --resume-timeout
RESUMING = resume.shorter(120)
GREEDY = {"prompt": "hello", "max_tokens": 24, "temperature": 0.0}


@pytest.fixture(scope="module")
def reference(tiny_alone: Callable[[str], str]) -> str:
    """GREEDY's completion on one rank (``neuron generate``), which every split must give."""
    return tiny_alone("qwen3").removesuffix("\n")


def complete(server: Server) -> str:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "qwen3", **GREEDY}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaces]:
    with started(3, tmp_path_factory.mktemp("testbed")) as testbed:
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
    nothing_left(bed)


def nothing_left(bed: Namespaces) -> None:
    wait_until(lambda: not any(bed.workers(i) for i in range(3)), 10, "no neuron worker left on any host")


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
    boundary while streams run, stops its worker, and leaves it out of the hostfile; drained in its turn with no
    spare left, the spare's rank leaves the group, and rank 0 serves alone."""
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
        # No spare stands by now: draining the host the rank moved to leaves rank 0 alone, the whole model on it.
        (moved,) = bed.workers(1)
        shrunk: list[subprocess.CompletedProcess[str]] = []
        resume.disturb(server, undisturbed, lambda: shrunk.append(hosts("drain", added)), bases=RESUMING)
        went_on = f"drained {added}: no spare stood by, so the group went on without rank 1, over 1 rank(s)"
        assert shrunk[0].returncode == 0 and went_on in shrunk[0].stdout, shrunk[0]
        wait_until(lambda: not alive(moved), 15, "the drained host's worker to be stopped")
        assert not bed.workers(1)
        status = httpx.get(f"{server.url}/v1/status", timeout=10).json()
        assert [r["host"] for r in status["ranks"]] == ["localhost"] and status["spares"] == []
        metrics = server.metrics()
        assert metrics[("neuron_rank_moves_total", (("cause", "drained"),))] == 1
        assert metrics[("neuron_group_shrinks_total", ())] == 1
        assert server.find_log("restarting") is None
        assert not [e for e in server.logs() if e.get("event") == "not resumed"]
    written = json.loads(hostfile.read_text())  # neither drained host stays: a restarted leader serves alone
    assert [h["ssh"] for h in written["hosts"]] == ["localhost"] and written["spares"] == []


def test_a_spare_that_dies_as_it_is_brought_in_passes_the_rank_to_the_next_and_every_stream_goes_on(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Host 0 dies for good with its rank; the first spare, host 1, is dead too: out of reach in its turn, it passes
    the rank on to host 2 after another ``--spare-timeout``, and both lost hosts are spares again, tried last."""
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(0)], "chain.json", spares=[bed.entry(1), bed.entry(2)])
    args = (
        *("--model", str(tiny_models["qwen3"]), "--hosts", str(hostfile), "--ssh-command", bed.ssh_command),
        *("--step-timeout", "3", "--spare-timeout", str(SPARE_S), "--resume-timeout", "90"),
    )
    lost, dead_spare, last = (f"root@{bed.ip(i)}" for i in range(3))
    try:
        with serving(tmp_path_factory, *args) as server:
            undisturbed = resume.references(server.url, RESUMING)
            bed.gone_for_good(1)  # the first spare, dead before it is needed

            resume.disturb(server, undisturbed, lambda: bed.gone_for_good(0), bases=RESUMING)
            moved = [
                (e["rank"], e["host"], e["spare"]) for e in server.logs() if e.get("event") == "rank moved to a spare"
            ]
            assert moved == [(1, lost, dead_spare), (1, dead_spare, last)], moved
            status = httpx.get(f"{server.url}/v1/status", timeout=10).json()
            assert [r["host"] for r in status["ranks"]] == ["localhost", last]
            assert status["spares"] == [
                {"host": lost, "state": "returning"},
                {"host": dead_spare, "state": "returning"},
            ]
            assert server.metrics()[("neuron_rank_moves_total", (("cause", "unreachable"),))] == 2
            assert server.find_log("restarting") is None
        written = json.loads(hostfile.read_text())  # where a restarted leader starts: rank 1 on host 2
        assert [h["ssh"] for h in written["hosts"]] == ["localhost", last]
        assert [h["ssh"] for h in written["spares"]] == [lost, dead_spare]
    finally:
        bed.back(0)
        bed.back(1)
    nothing_left(bed)


def test_a_host_dead_when_the_leader_starts_gives_its_rank_to_a_spare(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, reference: str
) -> None:
    """Out of reach from the start, host 0 is waited for (the leader restarts to try again) for ``--spare-timeout``,
    then its rank moves to the spare in the hostfile, which the fresh leader starts from, and serves."""
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(0)], "start.json", spares=[bed.entry(1)])
    lost, spare = f"root@{bed.ip(0)}", f"root@{bed.ip(1)}"
    args = (
        *("--model", str(tiny_models["qwen3"]), "--hosts", str(hostfile), "--ssh-command", bed.ssh_command),
        *("--spare-timeout", str(SPARE_S)),
    )
    bed.gone_for_good(0)
    try:
        with serving(tmp_path_factory, *args) as server:
            moved = server.find_log("rank moved to a spare")
            assert moved is not None and (moved["rank"], moved["host"], moved["spare"]) == (1, lost, spare), moved
            assert "out of reach at start" in moved["reason"]
            assert complete(server) == reference
            assert server.metrics()[("neuron_rank_moves_total", (("cause", "unreachable"),))] == 1
            assert bed.workers(1)
    finally:
        bed.back(0)
    written = json.loads(hostfile.read_text())
    assert [h["ssh"] for h in written["hosts"]] == ["localhost", spare]
    assert [h["ssh"] for h in written["spares"]] == [lost]
    nothing_left(bed)
