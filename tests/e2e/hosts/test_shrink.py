"""A group that shrinks, across namespaces with real sshd (testkit/testbed.py): a rank whose host dies for good, with no
spare left to take its place, leaves the group once it has been out of reach for ``--spare-timeout``. The model is
split again over the ranks that remain (a pipeline's stages planned again by their memory, a tensor-parallel group
over fewer ranks), every stream in flight ends with the text of an undisturbed run, the leader never restarts, and
``/v1/status``, the log, the metrics and the hostfile say what changed. A tensor-parallel group shrinking from two
ranks to one is tests/e2e/hosts/test_spares.py's drain with no spare left (the same ``Loader.shrunk`` and recovery,
the operator's cause). The decisions are tests/unit/pool/test_spares.py's and test_roster.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from testkit import resume, serving, wait_until
from testkit.testbed import Namespaces, started, unavailable

pytestmark = [pytest.mark.hosts, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

SPARE_S = 4  # short, so the test is; well under --resume-timeout
RESUMING = resume.shorter(120)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaces]:
    with started(2, tmp_path_factory.mktemp("testbed")) as testbed:
        yield testbed


def nothing_left(bed: Namespaces) -> None:
    wait_until(lambda: not any(bed.workers(i) for i in range(2)), 10, "no neuron worker left on any host")


def test_a_pipeline_stage_whose_host_is_gone_for_good_is_planned_away_and_every_stream_goes_on(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Three stages, one per host; the last host dies for good with no spare: two stages, planned again over the
    two hosts left by their memory, serve the same tokens."""
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(0), bed.entry(1)], "pp3.json")
    lost = f"root@{bed.ip(1)}"
    args = (
        *("--model", str(tiny_models["qwen3"]), "--pp", "3"),
        *("--hosts", str(hostfile), "--ssh-command", bed.ssh_command),
        *("--step-timeout", "3", "--spare-timeout", str(SPARE_S), "--resume-timeout", "90"),
    )
    with serving(tmp_path_factory, *args) as server:
        undisturbed = resume.references(server.url, RESUMING)
        try:
            resume.disturb(server, undisturbed, lambda: bed.gone_for_good(1), bases=RESUMING)
        finally:
            bed.back(1)
        shrunk = server.find_log("group shrunk")
        assert shrunk is not None and (shrunk["ranks"], shrunk["hosts"]) == ([2], [lost]), shrunk
        assert (shrunk["world_size"], shrunk["stages"]) == (2, 2), shrunk
        assert "--spare-timeout" in shrunk["reason"] and "no spare left" in shrunk["reason"]
        assert server.find_log("restarting") is None  # the leader never restarted
        assert not bed.workers(1)
        status = httpx.get(f"{server.url}/v1/status", timeout=10).json()
        document = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
        schema = document["paths"]["/v1/status"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        jsonschema.validate(status, {**schema, "components": document["components"]})  # the shrink and its event too
        assert (status["world_size"], status["pipeline_stages"]) == (2, 2)
        layers = [r["layers"] for r in status["ranks"]]
        assert [r["host"] for r in status["ranks"]] == ["localhost", f"root@{bed.ip(0)}"]
        assert sum(end - first for first, end in layers) == 4 and layers[0][0] == 0, layers  # every layer, once
        (shrink,) = status["shrinks"]
        assert shrink["hosts"] == [lost] and shrink["world_size"] == 2
        assert any(e["event"] == "shrunk" for e in status["events"]), status["events"]
        assert status["spares"] == [{"host": lost, "state": "returning"}]  # a spare again, should it come back
        metrics = server.metrics()
        assert metrics[("neuron_group_shrinks_total", ())] == 1
        assert not [key for key in metrics if key[0] == "neuron_rank_info" and ("host", lost) in key[1]]
    written = json.loads(hostfile.read_text())  # where a restarted leader starts: the smaller group
    assert [h["ssh"] for h in written["hosts"]] == ["localhost", f"root@{bed.ip(0)}"]
    assert [h["ssh"] for h in written["spares"]] == [lost]
    nothing_left(bed)
