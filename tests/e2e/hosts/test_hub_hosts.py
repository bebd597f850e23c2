"""A model named on the Hub, served over hosts of the namespace test bed (testkit/testbed.py): a host that
reaches the Hub fetches from it the files its stage's layers lie in, and no others, with the leader's token for a
gated repository (which no command line and no log line shows); a host with no route to the Hub receives its
share from the leader (neuron/launch/push.py) without being told to; with ``--push-model``, no host but the leader
asks the Hub.

The local Hub (testkit/hub.py) listens on an address of its own in the root namespace. The leader, there, reaches
it; host 0 gets a route to it through the bridge; host 1 gets none, so its attempts fail at once (no route).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from neuron.models.shares import INDEX
from testkit import file_per_layer, run_neuron
from testkit.hub import LocalHub
from testkit.testbed import Namespaces, unavailable

pytestmark = [pytest.mark.hosts, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

PROMPT = "hello"
TOKEN = "hf_granted_to_the_leader"


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaces]:
    testbed = Namespaces(2, tmp_path_factory.mktemp("hubbed"))
    try:
        yield testbed.start()
    finally:
        testbed.close()


@pytest.fixture(scope="module")
def local_hub(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalHub]:
    address = f"10.{bed.net}.9.1"
    # The bridge goes with the bed, and this address with it.
    subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", bed.bridge], check=True)
    subprocess.run(
        ["ip", "netns", "exec", bed.namespaces[0], "ip", "route", "add", address, "via", bed.leader_ip], check=True
    )
    with LocalHub(host=address) as server:
        server.tokens = {TOKEN}
        # Gated, and one layer to a file (model-00001-of-00005 the embedding and final norm, then layers 0 to 3).
        sharded = file_per_layer(tiny_models["qwen3"], tmp_path_factory.mktemp("hubmodel") / "tiny")
        server.add("org/tiny", sharded, token=TOKEN)
        yield server


def host_entry(bed: Namespaces, host: int, root: Path, hub_url: str) -> dict:
    """Host ``host``'s entry: its own Hugging Face cache and neuron cache, both empty at first."""
    env = {
        "HF_HOME": str(root / f"host{host}-hf"),
        "HF_ENDPOINT": hub_url,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NEURON_CACHE_DIR": str(root / f"host{host}-neuron"),
    }
    return {**bed.entry(host), "neuron": bed.neuron_command(env)}


def generate(bed: Namespaces, hub_url: str, root: Path, *args: str) -> tuple[str, str]:
    """The text, and the leader's stderr (its log lines and its workers', JSON) followed by every ssh command
    line it ran (recorded by a wrapper around ssh)."""
    env = {"HF_HOME": str(root / "leader-hf"), "HF_ENDPOINT": hub_url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": TOKEN}
    env |= {"HF_HUB_DISABLE_TELEMETRY": "1", "NEURON_LOG_LEVEL": "info", "NEURON_LOG_FORMAT": "json"}
    root.mkdir(parents=True)
    ssh = root / "ssh"
    ssh.write_text(f'#!/bin/sh\nprintf "ssh %s\\n" "$*" >> {root}/ssh.log\nexec ssh "$@"\n')
    ssh.chmod(0o755)
    hostfile = bed.hostfile(
        [bed.entry(-1), host_entry(bed, 0, root, hub_url), host_entry(bed, 1, root, hub_url)], f"{root.name}.json"
    )
    done = run_neuron(
        "generate",
        "--model",
        "org/tiny",
        "--hosts",
        str(hostfile),
        "--pp",
        "3",
        "--pp-layers",
        "2,1,1",  # host 0's stage: layer 2 alone, in model-00004-of-00005
        "--max-tokens",
        "24",
        "--ssh-command",
        f"{ssh} {bed.ssh_command.removeprefix('ssh ')}",
        "--log-level",
        "info",  # the pushes are read from the log, and generate logs warnings only unless asked
        *args,
        PROMPT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sessions = (root / "ssh.log").read_text()
    assert "--worker" in sessions, sessions
    return done.stdout, done.stderr + sessions


def events(stderr: str, event: str) -> list[dict]:
    return [e for line in stderr.splitlines() if line.startswith("{") and (e := json.loads(line))["event"] == event]


def leader_address(local_hub: LocalHub) -> str | None:
    """Where the leader's requests come from: the Hub's own address (both lie in the root namespace)."""
    return urlsplit(local_hub.url).hostname


def weights_in(hf_home: Path) -> list[str]:
    return sorted(p.name for p in hf_home.rglob("snapshots/*/model*.safetensors"))


def test_a_host_fetches_its_stages_files_with_the_leaders_token_and_one_without_a_route_gets_its_share(
    bed: Namespaces, local_hub: LocalHub, tiny_alone: Callable[[str], str], tmp_path: Path
) -> None:
    reference = tiny_alone("qwen3")  # what the same generate prints on one rank (the Hub's org/tiny is this model)

    root = tmp_path / "by-hub"
    text, stderr = generate(bed, local_hub.url, root)
    assert text == reference
    fetched = [r for r in local_hub.requests if r.method == "GET" and r.status in (200, 206)]
    assert {r.client for r in fetched} == {leader_address(local_hub), bed.ip(0)}  # host 1 never reached the Hub
    # Host 0 fetched, with the token the leader forwarded, the files of its stage (layer 2) and nothing else.
    asked = [r for r in local_hub.requests if r.client == bed.ip(0) and not r.path.startswith("/content/")]
    assert asked and {r.authorization for r in asked} == {TOKEN}  # the content host, as the Hub's, takes none
    assert len(weights_in(root / "leader-hf")) == 5
    assert weights_in(root / "host0-hf") == ["model-00004-of-00005.safetensors"]
    assert list((root / "host0-hf").rglob(f"snapshots/*/{INDEX}"))
    assert not weights_in(root / "host1-hf")
    pushes = events(stderr, "push started")
    assert [e["host"] for e in pushes] == [f"root@{bed.ip(1)}"], pushes
    assert list((root / "host1-neuron" / "shares").glob("*/*/plan.json"))
    # The token is on no ssh command line (and so in no process listing there) and in no log line.
    assert TOKEN not in stderr

    # --push-model: the hosts ask the leader only, never the Hub.
    local_hub.requests.clear()
    root = tmp_path / "by-leader"
    text, stderr = generate(bed, local_hub.url, root, "--push-model")
    assert text == reference
    assert {r.client for r in local_hub.requests} == {leader_address(local_hub)}
    pushes = events(stderr, "push started")
    assert sorted(e["host"] for e in pushes) == sorted(f"root@{bed.ip(i)}" for i in range(2))
    assert not weights_in(root / "host0-hf") and not weights_in(root / "host1-hf")
