"""--push-model across hosts: a host without the model gets, over SSH, exactly the share its rank loads.

Each remote host is a namespace of the test bed (testkit/testbed.py) with a neuron cache of its own
(``NEURON_CACHE_DIR`` in its hostfile entry's command), empty at first, and a model path that does not exist
there, so that it holds no model but what the leader sends.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from testkit import Server, faults, run_neuron, wait_until
from testkit.testbed import Namespaces, unavailable

pytestmark = [pytest.mark.hosts, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

PROMPT = "hello"


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaces]:
    testbed = Namespaces(2, tmp_path_factory.mktemp("pushbed"))
    try:
        yield testbed.start()
    finally:
        testbed.close()


@pytest.fixture(scope="module")
def reference(tiny_alone: Callable[[str], str]) -> str:
    """The model's greedy text on one rank (``generate`` below asks for as many tokens)."""
    return tiny_alone("qwen3")


def empty_host(bed: Namespaces, host: int, cache: Path, model: str = "/nowhere/qwen3", **env: str) -> dict:
    """Host ``host``'s entry: its own (empty) cache, and no model of its own (or ``model``)."""
    command = bed.neuron_command({"NEURON_CACHE_DIR": str(cache), **env}, faults.ENTRY)
    return {**bed.entry(host), "model": model, "neuron": command}


def generate(bed: Namespaces, *args: str) -> tuple[str, list[dict]]:
    """Greedy text and the leader's log (JSON lines); it must succeed."""
    done = run_neuron("generate", "--max-tokens", "24", "--log-level", "info", "--ssh-command", bed.ssh_command, *args,
                      PROMPT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]


def events(logs: list[dict], event: str) -> list[dict]:
    return [entry for entry in logs if entry.get("event") == event]


def share_of(cache: Path) -> Path:
    (plan,) = (cache / "shares").glob("*/*/plan.json")
    return plan.parent


def payload(share: Path) -> int:
    """Bytes of the share's tensors and files, as the leader sends them (its protocol lines aside)."""
    files = json.loads((share / "plan.json").read_text())["files"]
    return sum(e["size"] for e in json.loads((share / "plan.json").read_text())["entries"]) + sum(
        (share / name).stat().st_size for name in files
    )


def _ssh_receivers(pid: int) -> list[int]:
    """The leader's ssh processes that carry a push (``--receive-share``)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == pid and command.startswith(b"ssh") and b"--receive-share" in command:
            out.append(int(entry.name))
    return out


def test_a_host_without_the_model_gets_its_tp_share_resumed_after_a_cut_and_a_changed_tensor_back(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path: Path, reference: str
) -> None:
    model = str(tiny_models["qwen3"])
    cache = tmp_path / "host0-cache"
    hostfile = bed.hostfile([bed.entry(-1), empty_host(bed, 0, cache, **{faults.SLOW_PUSH_ENV: "0.02"})], "push.json")
    hosts = ("--model", model, "--hosts", str(hostfile))

    # Without the setting, today's refusal stands, and says what would fix it.
    refused = run_neuron("generate", *hosts, "--ssh-command", bed.ssh_command, PROMPT)
    assert refused.returncode == 1 and "--push-model" in refused.stderr.strip().splitlines()[-1], refused.stderr
    assert not (cache / "shares").exists()

    # A push cut midway (its ssh killed): the leader tries again, resumes, and serves.
    host = f"root@{bed.ip(0)}"
    server = Server(*hosts, "--push-model", "--ssh-command", bed.ssh_command, log_path=tmp_path / "serve.log")
    try:

        def midway() -> bool:
            progress = list((cache / "shares").glob("*/*/progress.jsonl"))
            return bool(progress) and len(progress[0].read_text().splitlines()) >= 10

        wait_until(midway, 60, "the push to be under way")
        (ssh,) = _ssh_receivers(server.process.pid)
        os.kill(ssh, signal.SIGKILL)
        server.wait_log("host unreachable; trying again", timeout=30)
        server.start()
        first, second = [e for e in server.logs() if e.get("event") == "push started"]
        share = share_of(cache)
        total = payload(share)
        assert first["held_bytes"] == 0 and first["bytes"] == total
        assert 0 < second["held_bytes"] < total and second["bytes"] == total - second["held_bytes"]  # resumed
        # The counter is the latest leader's: what it sent, this share's rest and its few protocol lines.
        sent = server.metrics()[("neuron_push_bytes_total", (("host", host),))]
        assert second["bytes"] <= sent < second["bytes"] + 16384
        response = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "qwen3", "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0},
            timeout=60,
        )
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == reference.rstrip("\n")
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]

    # Rank 1's share, not the whole model: its halves of every layer's projections, the rest whole.
    whole = load_file(str(Path(model) / "model.safetensors"))
    pushed = load_file(str(share / "model.safetensors"))
    assert set(pushed) == set(whole)
    for name, tensor in pushed.items():
        full = whole[name]
        if tensor.shape == full.shape:
            assert np.array_equal(tensor, full), name
        else:
            axis = next(a for a in range(full.ndim) if tensor.shape[a] != full.shape[a])
            assert np.array_equal(tensor, np.split(full, 2, axis=axis)[1]), name
    assert total < 0.6 * (Path(model) / "model.safetensors").stat().st_size

    # A later start finds it whole and sends nothing.
    text, logs = generate(bed, *hosts, "--push-model")
    assert text == reference and not events(logs, "push started") and events(logs, "loading a pushed share")

    # One tensor changed on the host: found by its digest, and that tensor alone sent again.
    header_length = int.from_bytes((share / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((share / "model.safetensors").read_bytes()[8 : 8 + header_length])
    name = sorted(k for k in header if k.endswith("mlp.down_proj.weight"))[0]
    with (share / "model.safetensors").open("r+b") as f:
        f.seek(8 + header_length + header[name]["data_offsets"][1] - 64)  # its last bytes: no sample would see them
        f.write(bytes(64))
    text, logs = generate(bed, *hosts, "--push-model")
    (again,) = events(logs, "push started")
    assert again["bytes"] == header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
    assert text == reference


def test_a_pipeline_stage_gets_its_layers_alone(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path: Path, reference: str
) -> None:
    """Host 1 holds another model (the llama): it gets the qwen3's layers of its stage all the same."""
    model = str(tiny_models["qwen3"])
    cache = tmp_path / "host1-cache"
    hostfile = bed.hostfile([bed.entry(-1), empty_host(bed, 1, cache, str(tiny_models["llama"]))], "push-pp.json")
    stages = ("--pp", "2", "--pp-layers", "1,3")
    text, logs = generate(bed, "--model", model, "--hosts", str(hostfile), *stages, "--push-model")
    assert text == reference
    share = share_of(cache)
    assert share.name == "pp-1-4"
    (done,) = events(logs, "push done")
    assert payload(share) <= done["bytes"] < payload(share) + 16384
    whole = load_file(str(Path(model) / "model.safetensors"))
    pushed = load_file(str(share / "model.safetensors"))
    # Layers 1 to 3, whole and under their own names; no embedding, final norm or head (rank 0's).
    assert set(pushed) == {n for n in whole if any(f"layers.{i}." in n for i in (1, 2, 3))}
    assert all(np.array_equal(pushed[n], whole[n]) for n in pushed)
