"""Several models in one server (issue 63): a router in front of a ``neuron serve`` per model, each split its own
way. Two tiny models at once, the qwen3 at TP=2 and the llama at PP=2 (served under the name "little"), each
answering as mlx-lm's greedy generation does on the same weights; one whose load fails, answering with why while
the others go on; one too large for the host, refused with what it needs and who holds the memory; routing by
``model`` on every family, refusals in each family's shape, the admin routes, the page's status, a stream asked of
a model that is not loaded, embeddings beside chat through both SDKs, and one model's recovery beside the other's
stream. Residency under a cap: tests/e2e/models/test_residency.py. The decisions: tests/unit/router/.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from testkit import Server, run_neuron, serving, sse_events, wait_until
from testkit.adapters import make_adapter
from testkit.arch_checks import PROMPTS, reference

PROMPT = PROMPTS[0]


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("broken")
    (folder / "config.json").write_text('{"model_type": "no_such_architecture"}')
    return folder


@pytest.fixture(scope="module")
def huge(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose weights (a sparse file: nothing is written) need nearly all of this host's memory: less than
    it has in all, so that it is not refused at start, and more than it has free beside this test's processes."""
    from neuron.launch import cgroup
    from neuron.launch.hosts import total_memory
    from neuron.router.child import BESIDE_WEIGHTS, PER_PROCESS

    group = cgroup.own_group()
    total = total_memory(cgroup.room(group) if group else None)
    folder = tmp_path_factory.mktemp("huge")
    (folder / "config.json").write_text((tiny_models["qwen3"] / "config.json").read_text())
    with open(folder / "model.safetensors", "wb") as weights:
        weights.truncate(int((total - (200 << 20) - PER_PROCESS) / (1 + BESIDE_WEIGHTS)))
    return folder


@pytest.fixture(scope="module")
def router(
    tiny_models: dict[str, Path], broken: Path, huge: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    adapter = make_adapter(tiny_models["llama"], tmp_path_factory.mktemp("adapters") / "fr", seed=1)
    config = tmp_path_factory.mktemp("config") / "neuron.toml"
    config.write_text(
        "speculate = 'off'\n"
        f"[[models]]\nmodel = '{tiny_models['qwen3']}'\ntp = 2\npreload = true\n"
        f"[[models]]\nmodel = '{tiny_models['llama']}'\nname = 'little'\npp = 2\nadapter = ['fr={adapter}']\n"
        f"[[models]]\nmodel = '{broken}'\nname = 'broken'\n"
        f"[[models]]\nmodel = '{huge}'\nname = 'huge'\n"
    )
    with serving(tmp_path_factory, "--config", str(config)) as started:
        yield started


def _greedy_text(model: Path) -> str:
    return AutoTokenizer.from_pretrained(model).decode(reference(str(model))["prompts"][0])


def _complete(router: Server, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **extra}
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)


def _states(router: Server) -> dict[str, str]:
    listed = httpx.get(f"{router.url}/v1/models").json()["data"]
    return {entry["id"]: entry["status"]["value"] for entry in listed}


def test_two_models_at_once_each_split_its_own_way_answer_as_mlx_lm(
    router: Server, tiny_models: dict[str, Path]
) -> None:
    router.wait_log("model state", 60, model="qwen3", state="loaded")  # preloaded: loaded at start, unasked
    assert _states(router) == {
        "qwen3": "loaded", "little": "unloaded", "broken": "unloaded", "huge": "unloaded", "fr": "unloaded"
    }  # fmt: skip
    for name, folder in (("qwen3", "qwen3"), ("little", "llama")):  # the llama served under a name of its own
        reply = _complete(router, name)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == name
        assert reply.json()["choices"][0]["text"] == _greedy_text(tiny_models[folder])
    assert _states(router) == {
        "qwen3": "loaded", "little": "loaded", "broken": "unloaded", "huge": "unloaded", "fr": "loaded"
    }  # fmt: skip
    status = {
        m["id"]: m["server"]["ranks"] for m in httpx.get(f"{router.url}/v1/status").json()["models"] if m["server"]
    }
    assert [r["heads"] for r in status["qwen3"]] == [2, 2]  # TP=2: each rank half the heads of every layer
    assert [r["layers"] for r in status["little"]] == [[0, 2], [2, 4]]  # PP=2: each rank its run of layers
    for rank in status["qwen3"]:  # five models may be loaded at once: each budgets its caches from a fifth
        memory = rank["memory"]
        assert memory["budget_bytes"] < (memory["free_bytes"] + memory["caches_bytes"]) / 5, memory
    for name in ("qwen3", "little"):  # every entry of a model's server names its model
        assert router.find_log("request started", model=name) is not None
        assert router.find_log("group ready", model=name) is not None


def test_a_model_whose_load_fails_answers_why_and_the_others_go_on(router: Server) -> None:
    reply = _complete(router, "broken")
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "model_load_failed" and "has no model*.safetensors weights" in error["message"], error
    listed = {e["id"]: e["status"] for e in httpx.get(f"{router.url}/v1/models").json()["data"]}
    assert listed["broken"]["value"] == "failed" and "safetensors" in listed["broken"]["reason"]
    assert _complete(router, "qwen3").status_code == 200


def test_a_model_that_cannot_fit_says_what_it_needs_and_who_holds_the_memory(router: Server) -> None:
    assert _complete(router, "qwen3").status_code == 200
    reply = _complete(router, "huge")
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == "model_too_large"
    assert error["message"].startswith("huge needs about"), error
    assert "GiB here (its weights and its server), and this host has" in error["message"], error
    assert "qwen3 holds" in error["message"] and "GiB free" in error["message"]
    assert _states(router)["huge"] == "unloaded" and _states(router)["qwen3"] == "loaded"  # nothing was unloaded


def test_an_adapter_stays_a_model_of_its_base(router: Server) -> None:
    listed = {e["id"]: e for e in httpx.get(f"{router.url}/v1/models").json()["data"]}
    assert listed["fr"]["parent"] == "little"
    reply = _complete(router, "fr")
    assert reply.status_code == 200 and reply.json()["model"] == "fr", reply.text
    assert reply.json()["choices"][0]["text"] != _complete(router, "little").json()["choices"][0]["text"]


def test_every_family_routes_by_model_and_refuses_an_unknown_one_in_its_own_shape(router: Server) -> None:
    chat = {"model": "little", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=60).json()["model"] == "little"
    responses = {"model": "little", "input": "hi", "max_output_tokens": 3}
    answered = httpx.post(f"{router.url}/v1/responses", json=responses, timeout=60)
    assert answered.status_code == 200 and answered.json()["model"] == "little", answered.text
    messages = httpx.post(f"{router.url}/v1/messages", json=chat, timeout=60)
    assert messages.status_code == 200 and messages.json()["model"] == "little", messages.text
    tokens = httpx.post(f"{router.url}/tokenize", json={"model": "qwen3", "prompt": "hello"}, timeout=60)
    assert tokens.status_code == 200 and tokens.json()["count"] > 0, tokens.text
    unknown = _complete(router, "gpt-4")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == (
        "the model 'gpt-4' does not exist; this server serves qwen3, little, broken, huge, fr"
    )
    anthropic = httpx.post(f"{router.url}/v1/messages", json={**chat, "model": "claude"}, timeout=60)
    assert anthropic.status_code == 404 and anthropic.json()["error"]["type"] == "not_found_error"
    unnamed = httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi"}, timeout=60)
    assert unnamed.status_code == 400 and unnamed.json()["error"]["code"] == "model_required"


def test_a_stream_asked_of_an_unloaded_model_loads_it_and_streams(router: Server, tiny_models: dict[str, Path]) -> None:
    assert _complete(router, "little").status_code == 200
    unloaded = httpx.post(f"{router.url}/models/unload", json={"model": "little"}, timeout=60)
    assert unloaded.status_code == 200 and unloaded.json()["status"]["value"] == "unloaded", unloaded.text
    assert _states(router)["little"] == "unloaded"
    body = {
        "model": "little",
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as reply:
        events = [e for e in sse_events(reply) if isinstance(e, dict)]
    assert "".join(c["text"] for e in events for c in e["choices"]) == _greedy_text(tiny_models["llama"])
    assert _states(router)["little"] == "loaded"
    loaded = httpx.post(f"{router.url}/models/load", json={"model": "little"}, timeout=60)
    assert loaded.status_code == 200 and loaded.json()["status"]["value"] == "loaded"
    nothing = httpx.post(f"{router.url}/models/load", json={"model": "nothing"}, timeout=60)
    assert nothing.status_code == 404


def test_the_openapi_document_names_every_model_and_the_routers_own_routes(router: Server) -> None:
    document = httpx.get(f"{router.url}/openapi.json", timeout=60).json()
    assert {"/models/load", "/models/unload", "/v1/chat/completions", "/v1/messages"} <= set(document["paths"])
    load = document["paths"]["/models/load"]["post"]
    model = load["requestBody"]["content"]["application/json"]["schema"]["properties"]["model"]
    assert model["enum"] == ["qwen3", "little", "broken", "huge"]
    assert "admin route" in load["description"]


def test_embeddings_beside_chat_through_both_sdks(router: Server, tiny_models: dict[str, Path]) -> None:
    """One model embeds (the qwen3, at TP=2: its vectors as mlx-lm computes them on the same weights) while the
    other chats, through OpenAI's and Anthropic's own clients."""
    import anthropic
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from openai import OpenAI

    openai_client = OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    got = openai_client.embeddings.create(model="qwen3", input=[PROMPT], encoding_format="float")
    model, _ = load(str(tiny_models["qwen3"]))
    states = model.model(mx.array([PROMPT]))[0].astype(mx.float32).mean(axis=0)
    expected = np.array(states / mx.linalg.norm(states))
    assert np.abs(np.array(got.data[0].embedding) - expected).max() < 1e-4
    turn = [{"role": "user", "content": "Hello"}]
    chat = openai_client.chat.completions.create(model="little", messages=turn, max_tokens=4)  # type: ignore[arg-type]
    assert chat.model == "little" and chat.choices[0].message.content is not None
    claude = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    message = claude.messages.create(model="little", max_tokens=4, messages=turn)  # type: ignore[arg-type]
    assert message.model == "little" and message.content


def test_one_models_recovery_leaves_the_others_stream_undisturbed(router: Server, tiny_models: dict[str, Path]) -> None:
    """A worker of the qwen3's group is killed while the llama streams: the qwen3's server recovers in its own
    process, and the llama's stream goes on as if nothing happened, ending with its text alone."""
    assert _complete(router, "qwen3").status_code == 200
    alone = _complete(router, "little", max_tokens=600).json()["choices"][0]["text"]
    body = {
        "model": "little",
        "prompt": PROMPT,
        "max_tokens": 600,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    pieces: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as reply:
            for event in sse_events(reply):
                if isinstance(event, dict):
                    pieces.extend(choice["text"] for choice in event["choices"])
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    readies = len(_entries(router, "ready", model="qwen3"))
    worker = _entries(router, "workers started", model="qwen3")[-1]["pids"][0]
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: len(_entries(router, "ready", model="qwen3")) > readies, 60, "the qwen3 to recover")
    reader.join(120)
    assert "".join(pieces) == alone
    recovering = _entries(router, "recovering", model="qwen3")[-1]
    ended = _entries(router, "request done", model="little", completion_tokens=600)[-1]
    assert recovering["timestamp"] < ended["timestamp"]  # the stream was in flight as the other model recovered
    assert not _entries(router, "recovering", model="little")
    assert _complete(router, "qwen3").json()["choices"][0]["text"] == _greedy_text(tiny_models["qwen3"])


def _entries(router: Server, event: str, **fields: object) -> list[dict]:
    return [e for e in router.logs() if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())]


def test_the_page_is_served_with_each_models_status_for_its_picker(router: Server) -> None:
    page = httpx.get(f"{router.url}/", timeout=60)
    assert page.status_code == 200 and 'id="model-picker"' in page.text
    assert httpx.get(f"{router.url}/page/page.js", timeout=60).status_code == 200
    assert _complete(router, "qwen3").status_code == 200
    qwen3 = httpx.get(f"{router.url}/v1/status", params={"model": "qwen3"}, timeout=60).json()
    assert qwen3["model"]["id"] == "qwen3" and qwen3["ready"] is True and len(qwen3["ranks"]) == 2
    assert [m["id"] for m in qwen3["models"]] == ["qwen3", "little", "broken", "huge", "fr"]
    broken = httpx.get(f"{router.url}/v1/status", params={"model": "broken"}, timeout=60).json()
    assert broken["model"]["id"] == "broken" and broken["ready"] is False and broken["ranks"] == []
    assert httpx.get(f"{router.url}/v1/status", params={"model": "nope"}, timeout=60).status_code == 404


def test_entries_whose_hosts_overlap_beyond_a_hosts_memory_are_refused_at_start(tmp_path: Path) -> None:
    """Two tables whose hostfiles put a rank each on the host "far", which has 1 GiB: each model's share fits it
    alone, both together do not. Its memory is read over SSH (here a stand-in for ssh that answers as that host)."""
    ssh = tmp_path / "ssh"
    ssh.write_text("#!/bin/sh\necho 'MemTotal:        1048576 kB'\n")
    ssh.chmod(0o755)
    tables = ""
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        with open(folder / "model.safetensors", "wb") as weights:
            weights.truncate(600 << 20)  # sparse: nothing is written
        hostfile = tmp_path / f"{name}.json"
        hostfile.write_text('[{"ssh": "localhost"}, {"ssh": "far"}]')
        tables += f"[[models]]\nmodel = '{folder}'\nhosts = '{hostfile}'\n"
    config = tmp_path / "neuron.toml"
    config.write_text(f"ssh_command = '{ssh}'\n{tables}")
    done = run_neuron("serve", "--config", str(config), timeout=60)
    assert done.returncode == 2, done.stderr
    assert "the models 'a', 'b' have ranks on the host far and may be loaded together" in done.stderr
    assert "more than its 1.0 GiB" in done.stderr and "--models-max 1" in done.stderr
