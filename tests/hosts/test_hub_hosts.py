"""A model named on the Hub, served over hosts of the namespace test bed (testkit/testbed.py): a host that
reaches the Hub fetches its files from it; a host with no route to the Hub receives its share from the leader
(neuron/launch/push.py) without being told to; with ``--push-model``, no host but the leader asks the Hub.

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
from conftest import run_neuron

from testkit.hub import LocalHub
from testkit.testbed import Namespaces, unavailable

pytestmark = [pytest.mark.hosts, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

PROMPT = "hello"


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaces]:
    testbed = Namespaces(2, tmp_path_factory.mktemp("hubbed"))
    try:
        yield testbed.start()
    finally:
        testbed.close()


@pytest.fixture(scope="module")
def local_hub(bed: Namespaces, tiny_models: dict[str, Path]) -> Iterator[LocalHub]:
    address = f"10.{bed.net}.9.1"
    # The bridge goes with the bed, and this address with it.
    subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", bed.bridge], check=True)
    subprocess.run(
        ["ip", "netns", "exec", bed.namespaces[0], "ip", "route", "add", address, "via", bed.leader_ip], check=True
    )
    with LocalHub(host=address) as server:
        server.add("org/tiny", tiny_models["qwen3"])
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


def generate(bed: Namespaces, hub_url: str, root: Path, *args: str) -> tuple[str, list[dict]]:
    env = {"HF_HOME": str(root / "leader-hf"), "HF_ENDPOINT": hub_url, "HF_HUB_DISABLE_XET": "1"}
    env |= {"HF_HUB_DISABLE_TELEMETRY": "1", "NEURON_LOG_LEVEL": "info", "NEURON_LOG_FORMAT": "json"}
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
        "--max-tokens",
        "24",
        "--ssh-command",
        bed.ssh_command,
        "--log-level",
        "info",  # the pushes are read from the log, and generate logs warnings only unless asked
        *args,
        PROMPT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]


def leader_address(local_hub: LocalHub) -> str | None:
    """Where the leader's requests come from: the Hub's own address (both lie in the root namespace)."""
    return urlsplit(local_hub.url).hostname


def weights_in(hf_home: Path) -> list[Path]:
    return list(hf_home.rglob("snapshots/*/model.safetensors"))


def test_a_host_fetches_from_the_hub_and_one_without_a_route_gets_its_share_from_the_leader(
    bed: Namespaces, local_hub: LocalHub, tiny_alone: Callable[[str], str], tmp_path: Path
) -> None:
    reference = tiny_alone("qwen3")  # what the same generate prints on one rank (the Hub's org/tiny is this model)

    root = tmp_path / "by-hub"
    text, logs = generate(bed, local_hub.url, root)
    assert text == reference
    clients = {r.client for r in local_hub.requests if r.method == "GET" and r.status in (200, 206)}
    assert clients == {leader_address(local_hub), bed.ip(0)}  # host 1 never reached the Hub
    assert weights_in(root / "leader-hf") and weights_in(root / "host0-hf")
    assert not weights_in(root / "host1-hf")
    pushes = [e for e in logs if e.get("event") == "push started"]
    assert [e["host"] for e in pushes] == [f"root@{bed.ip(1)}"], pushes
    assert list((root / "host1-neuron" / "shares").glob("*/*/plan.json"))

    # --push-model: the hosts ask the leader only, never the Hub.
    local_hub.requests.clear()
    root = tmp_path / "by-leader"
    text, logs = generate(bed, local_hub.url, root, "--push-model")
    assert text == reference
    assert {r.client for r in local_hub.requests} == {leader_address(local_hub)}
    pushes = [e for e in logs if e.get("event") == "push started"]
    assert sorted(e["host"] for e in pushes) == sorted(f"root@{bed.ip(i)}" for i in range(2))
    assert not weights_in(root / "host0-hf") and not weights_in(root / "host1-hf")
