"""``neuron hosts`` against a real leader, as an operator runs it: it lists the group, adds and removes a spare through
the guarded admin routes, refuses a host already in the group with the leader's reason, and what it changed is in
the hostfile that the next leader starts from. One rank on this host: no test bed is needed for the commands.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit import run_neuron, serving

LEADER = {"ssh": "localhost", "ips": ["127.0.0.1"]}
SPARE = "root@192.0.2.7"  # a documentation address: never reached, since nothing is lost


def hosts(url: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    done = run_neuron("hosts", *args, "--url", url, timeout=60, env=env)
    return done.returncode, done.stdout, done.stderr


def test_hosts_lists_adds_refuses_and_removes_and_the_next_leader_starts_from_the_hostfile(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([LEADER]))
    args = ("--model", str(tiny_models["qwen3"]), "--hosts", str(hostfile))
    with serving(tmp_path_factory, *args) as server:
        code, out, _ = hosts(server.url)
        assert code == 0 and out.splitlines()[:3] == [
            "rank   host       state",
            "0      localhost  ok",
            "spare  (none)",
        ], out
        code, out, err = hosts(server.url, "add", SPARE, "--ip", "192.0.2.7")
        assert code == 0 and f"added the spare {SPARE}; written to {hostfile}" in out, err
        assert f"spare  {SPARE}  standing by" in out
        code, _, err = hosts(server.url, "add", "localhost", "--ip", "127.0.0.1")
        assert code == 1 and "refused (409): localhost is already in the group (rank 0)" in err, err
        code, _, err = hosts(server.url, "add", "root@192.0.2.8")
        assert code == 1 and "refused (400)" in err and "has 0 'ips' where the hosts have 1" in err, err
        code, _, err = hosts(server.url, "remove", "localhost")
        assert code == 1 and "localhost runs rank 0, it is not a spare" in err, err
        assert server.find_log("spare added", host=SPARE) is not None
    assert json.loads(hostfile.read_text()) == {"hosts": [LEADER], "spares": [{"ssh": SPARE, "ips": ["192.0.2.7"]}]}

    with serving(tmp_path_factory, *args) as server:  # a fresh leader reads the spare back
        code, out, _ = hosts(server.url)
        assert code == 0 and f"spare  {SPARE}  standing by" in out, out
        code, out, err = hosts(server.url, "remove", SPARE)
        assert code == 0 and f"removed the spare {SPARE}" in out, err
        code, _, err = hosts(server.url, "remove", SPARE)
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
