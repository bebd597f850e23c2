"""``neuron hosts`` against a real leader, as an operator runs it: it lists the group, adds and removes a spare through
the guarded admin routes, refuses a host already in the group, out of reach, on other versions, short of memory or
without the leader's model with the leader's reason, and what it changed is in the hostfile that the next leader
starts from. The group is one rank on this host; the spares are namespaces of the test bed (testkit/testbed.py),
asked who they are over real SSH.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit import faults, run_neuron, serving
from testkit.testbed import Namespaces, started, unavailable

pytestmark = [pytest.mark.hosts, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

LEADER = {"ssh": "localhost", "ips": ["127.0.0.1"]}


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaces]:
    with started(2, tmp_path_factory.mktemp("testbed")) as testbed:
        yield testbed


def hosts(url: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    done = run_neuron("hosts", *args, "--url", url, timeout=120, env=env)
    return done.returncode, done.stdout, done.stderr


def test_hosts_lists_adds_refuses_and_removes_and_the_next_leader_starts_from_the_hostfile(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    hostfile = tmp_path / "hosts.json"
    leader = {"ssh": "localhost", "ips": [bed.leader_ip]}
    hostfile.write_text(json.dumps([leader]))
    spare, other = f"root@{bed.ip(0)}", f"root@{bed.ip(1)}"
    args = ("--model", str(tiny_models["qwen3"]), "--hosts", str(hostfile), "--ssh-command", bed.ssh_command)

    def add(host: int, neuron: str, *more: str) -> tuple[int, str, str]:
        return hosts(server.url, "add", f"root@{bed.ip(host)}", "--ip", bed.ip(host), "--neuron", neuron, *more)

    with serving(tmp_path_factory, *args) as server:
        code, out, _ = hosts(server.url)
        assert code == 0 and out.splitlines()[:3] == [
            "rank   host       state",
            "0      localhost  ok",
            "spare  (none)",
        ], out
        code, out, err = add(0, bed.neuron_command())
        assert code == 0 and f"added the spare {spare}; written to {hostfile}" in out, err
        assert f"spare  {spare}  standing by" in out
        code, _, err = hosts(server.url, "add", "localhost", "--ip", "127.0.0.1")
        assert code == 1 and "refused (409): localhost is already in the group (rank 0)" in err, err
        code, _, err = hosts(server.url, "add", other)
        assert code == 1 and "refused (400)" in err and "has 0 'ips' where the hosts have 1" in err, err
        liar = bed.neuron_command({faults.FAKE_HOST_ENV: "mlx=0.0.1"}, faults.ENTRY)
        code, _, err = add(1, liar)
        assert code == 1 and f"refused (422): the spare {other}" in err and "runs mlx 0.0.1" in err, err
        small = bed.neuron_command({faults.FAKE_HOST_ENV: "free_memory=1000"}, faults.ENTRY)
        code, _, err = add(1, small)
        assert code == 1 and "has 0 MiB available, but a rank's share" in err, err
        # Without --push-model, the spare must hold the leader's model: none at its path, or another one.
        code, _, err = add(1, bed.neuron_command(), "--model", str(tmp_path / "nowhere"))
        assert code == 1 and f"refused (422): the spare {other} cannot load the model" in err, err
        code, _, err = add(1, bed.neuron_command(), "--model", str(tiny_models["llama"]))
        assert code == 1 and f"the spare {other} holds another model than the leader" in err, err
        assert "has a different config.json" in err and "--push-model" in err, err
        bed.link(1, up=False)
        try:
            code, _, err = add(1, bed.neuron_command())
        finally:
            bed.link(1, up=True)
        assert code == 1 and f"refused (422): cannot reach the spare {other} as a worker" in err, err
        code, _, err = hosts(server.url, "remove", "localhost")
        assert code == 1 and "localhost runs rank 0, it is not a spare" in err, err
        assert server.find_log("spare added", host=spare) is not None
        assert not bed.workers(0) and not bed.workers(1)  # each probe's worker stopped once it answered
    entry = {"ssh": spare, "ips": [bed.ip(0)], "neuron": bed.neuron_command()}
    assert json.loads(hostfile.read_text()) == {"hosts": [leader], "spares": [entry]}

    with serving(tmp_path_factory, *args) as server:  # a fresh leader reads the spare back
        code, out, _ = hosts(server.url)
        assert code == 0 and f"spare  {spare}  standing by" in out, out
        code, out, err = hosts(server.url, "remove", spare)
        assert code == 0 and f"removed the spare {spare}" in out, err
        code, _, err = hosts(server.url, "remove", spare)
        assert code == 1 and "refused (404)" in err and "is not a spare (the spares: none)" in err, err
    assert json.loads(hostfile.read_text())["spares"] == []


def test_hosts_finds_the_leader_from_serves_settings_and_sends_its_key(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([LEADER]))
    with serving(
        tmp_path_factory, "--model", str(tiny_models["qwen3"]), "--hosts", str(hostfile), api_key="sesame"
    ) as server:
        found = {"NEURON_PORT": str(server.port), "NEURON_HOST": "0.0.0.0"}
        done = run_neuron("hosts", timeout=60, env={**found, "NEURON_API_KEY": "sesame"})
        assert done.returncode == 0 and "0      localhost  ok" in done.stdout, done.stderr
        done = run_neuron("hosts", timeout=60, env={**found, "NEURON_API_KEY": "wrong"})
        assert done.returncode == 1 and "refused (401): incorrect API key" in done.stderr, done.stderr
