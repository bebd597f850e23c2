"""LoRA adapters (issue 47): a tiny random base with two random adapters, one in mlx-lm's format and one in PEFT's.

Each adapter's tokens equal mlx-lm's own generation with that adapter loaded, at TP=1, TP=2 and PP=2, alone and
as rows of one batch beside the base model and the other adapter (``leader_scenarios.adapters``, token ids
exactly); a bad adapter is refused with its reason, at start and at the admin route. One served model (the
module's) covers the HTTP side: the model list, picking an adapter by ``model``, requests for different
adapters batched together, the prefix cache kept apart by adapter, and the admin routes behind the key. The
decisions alone: tests/unit/models/test_lora.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from neuron.engine.text import Text
from testkit import Server, make_tiny_model, run_neuron, serving
from testkit.adapters import make_adapter, reference
from testkit.scenarios import scenario

PROMPT = [5, 17, 99, 42, 7, 120, 64, 3, 88]  # leader_scenarios.PROMPT
COUNT = 12
KEY = "adapter-key"


@pytest.fixture(scope="module")
def adapters(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two good adapters of the tiny llama (``a`` in mlx-lm's format, ``b`` in PEFT's), and bad ones: trained for
    another base, with a rank its matrices do not have, without its weights."""
    root = tmp_path_factory.mktemp("adapters")
    base = tiny_models["llama"]
    other = make_tiny_model(root / "other-base", "llama", hidden=128)
    out = {
        "a": make_adapter(base, root / "a", seed=1),
        "b": make_adapter(base, root / "b", seed=2, peft=True, keys=("self_attn.k_proj", "mlp.gate_proj")),
        "other_base": make_adapter(other, root / "other_base", seed=3),
    }
    wrong_rank = shutil.copytree(out["a"], root / "wrong_rank")
    config = json.loads((wrong_rank / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 8
    (wrong_rank / "adapter_config.json").write_text(json.dumps(config))
    no_weights = root / "no_weights"
    no_weights.mkdir()
    shutil.copy(out["a"] / "adapter_config.json", no_weights)
    return out | {"wrong_rank": wrong_rank, "no_weights": no_weights}


@pytest.fixture(scope="module")
def expected(
    tiny_models: dict[str, Path], adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[int, list[int]]:
    """mlx-lm's greedy tokens: the base's, and each adapter's loaded by mlx-lm (``b`` as the mlx-lm adapter of the
    same matrices, since mlx-lm reads only its own format)."""
    base = tiny_models["llama"]
    b_as_mlx = make_adapter(
        base, tmp_path_factory.mktemp("b-mlx") / "b", seed=2, keys=("self_attn.k_proj", "mlp.gate_proj")
    )
    return {
        0: reference(base, None, PROMPT, COUNT),
        1: reference(base, adapters["a"], PROMPT, COUNT),
        2: reference(base, b_as_mlx, PROMPT, COUNT),
    }


@pytest.mark.parametrize(("world_size", "stages"), [(1, 1), (2, 1), (2, 2)], ids=["tp1", "tp2", "pp2"])
def test_each_adapter_gives_mlx_lms_tokens_alone_and_batched_with_the_others(
    tiny_models: dict[str, Path],
    adapters: dict[str, Path],
    expected: dict[int, list[int]],
    world_size: int,
    stages: int,
) -> None:
    good = {"a": str(adapters["a"]), "b": str(adapters["b"])}
    bad = {name: str(adapters[name]) for name in ("other_base", "wrong_rank")} if world_size == 2 else {}
    result = scenario("adapters", str(tiny_models["llama"]), world_size, stages, good, bad, COUNT)
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # each adapter changes the output
    assert {int(n): tokens for n, tokens in result["alone"].items()} == expected
    assert {int(n): tokens for n, tokens in result["together"].items()} == expected
    assert result["reloaded"] == expected[1] == result["after_refusals"]  # a load brings the adapters back
    # a: the last 3 of 4 layers, 5 projections each; b: 2 each. A stage holds its layers' alone ([0, 2) and [2, 4)).
    if stages == 2:
        assert result["layers"] == [[0, 2], [2, 4]]
        assert result["projections"] == {"a": [5, 10], "b": [2, 4]}
    else:
        assert result["projections"] == {"a": [15] * world_size, "b": [6] * world_size}
    for name, why in result["refused"].items():
        assert why.count("trained for another base model" if name == "other_base" else "share the rank 8") == 2, why


# The HTTP side: one server for the module.


@pytest.fixture(scope="module")
def server(
    tiny_models: dict[str, Path], adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    a, b = adapters["a"], adapters["b"]
    # Running ahead (a GPU's default) queues each decode step before the last one's tokens are read: its rows'
    # adapters come from the plan before.
    model = ("--model", str(tiny_models["llama"]), "--run-ahead", "on")
    with serving(tmp_path_factory, *model, "--adapter", f"a={a}", "--adapter", f"b={b}", api_key=KEY) as running:
        yield running


def _complete(server: Server, model: str, prompt: list[int] = PROMPT) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": COUNT, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, headers=_auth(), timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _as_served(model: Path, tokens: list[int]) -> str:
    """The text the server sends for ``tokens``: its detokenizer's (``engine.text``), special tokens left out."""
    text = Text.load(model)
    detokenizer = text.tokenizer.detokenizer
    detokenizer._maybe_trim_space = lambda piece: piece  # as ``Text.start`` has it: a completion keeps the space
    detokenizer.reset()
    for token in tokens:
        if token not in text.special_ids:
            detokenizer.add_token(token)
    detokenizer.finalize()
    return str(detokenizer.text)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_adapters_are_models_of_their_own_picked_by_model_and_batched_together(
    server: Server, tiny_models: dict[str, Path], expected: dict[int, list[int]]
) -> None:
    listed = httpx.get(f"{server.url}/v1/models", headers=_auth()).json()["data"]
    assert [(card["id"], card.get("parent")) for card in listed] == [("llama", None), ("a", "llama"), ("b", "llama")]
    assert httpx.get(f"{server.url}/v1/models/b", headers=_auth()).json()["parent"] == "llama"
    solo = {model: _complete(server, model)["choices"][0]["text"] for model in ("llama", "a", "b")}
    served = {model: _as_served(tiny_models["llama"], expected[n]) for n, model in enumerate(("llama", "a", "b"))}
    assert solo == served
    with ThreadPoolExecutor(3) as pool:
        together = dict(zip(solo, pool.map(lambda m: _complete(server, m)["choices"][0]["text"], solo), strict=True))
    assert together == solo
    assert server.metrics()[("neuron_steps_run_ahead_total", ())] > 0


def test_the_prefix_cache_keeps_each_adapters_entries_apart(server: Server) -> None:
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    first = _complete(server, "llama", prompt)
    assert _complete(server, "llama", prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    adapted = _complete(server, "a", prompt)  # the base's entry is not this adapter's
    assert adapted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert adapted["choices"][0]["text"] != first["choices"][0]["text"]
    assert _complete(server, "a", prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_admin_routes_load_and_unload_adapters_behind_the_key(server: Server, adapters: dict[str, Path]) -> None:
    load, unload = f"{server.url}/v1/load_lora_adapter", f"{server.url}/v1/unload_lora_adapter"
    body = {"lora_name": "c", "lora_path": str(adapters["a"])}
    assert httpx.post(load, json=body).status_code == 401
    for name, why in (
        ("other_base", "trained for another base model"),
        ("wrong_rank", "share the rank 8"),
        ("no_weights", "has neither adapters.safetensors"),
    ):
        refused = httpx.post(load, json={"lora_name": name, "lora_path": str(adapters[name])}, headers=_auth())
        assert refused.status_code == 400 and why in refused.json()["error"]["message"], refused.text
    missing = httpx.post(load, json={"lora_name": "d", "lora_path": "/nowhere"}, headers=_auth())
    assert missing.status_code == 400 and "not a folder" in missing.json()["error"]["message"]
    taken = httpx.post(load, json={"lora_name": "a", "lora_path": str(adapters["a"])}, headers=_auth())
    assert taken.status_code == 400 and "loaded already" in taken.text
    assert httpx.post(load, json=body, headers=_auth()).status_code == 200
    assert _complete(server, "c")["choices"][0]["text"] == _complete(server, "a")["choices"][0]["text"]
    chat = httpx.get(f"{server.url}/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]
    asked = chat["requestBody"]["content"]["application/json"]["schema"]["properties"]["model"]
    assert asked["enum"] == ["llama", "a", "b", "c"]
    assert httpx.post(unload, json={"lora_name": "c"}, headers=_auth()).status_code == 200
    ids = [card["id"] for card in httpx.get(f"{server.url}/v1/models", headers=_auth()).json()["data"]]
    assert ids == ["llama", "a", "b"]
    gone = httpx.post(f"{server.url}/v1/completions", json={"model": "c", "prompt": "x"}, headers=_auth())
    assert gone.status_code == 404
    again = httpx.post(unload, json={"lora_name": "c"}, headers=_auth())
    assert again.status_code == 400 and "no adapter 'c' is loaded" in again.text
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(paths)


def test_a_bad_adapter_at_start_ends_the_server_with_the_reason(
    tiny_models: dict[str, Path], adapters: dict[str, Path]
) -> None:
    model = str(tiny_models["llama"])
    done = run_neuron("serve", "--model", model, "--port", "0", "--adapter", f"x={adapters['other_base']}")
    assert done.returncode == 1 and "trained for another base model" in done.stderr, done.stderr[-2000:]
    done = run_neuron("serve", "--model", model, "--port", "0", "--adapter", "x")
    assert done.returncode == 2 and "is not NAME=PATH" in done.stderr, done.stderr[-2000:]


def test_an_adapter_named_on_the_hub_is_fetched_into_the_cache(adapters: dict[str, Path], tmp_path: Path) -> None:
    """Its config and weights only (not the README beside them), then from the cache alone when offline."""
    from testkit.hub import LocalHub, hub_env

    code = "from neuron.models.adapters import find; s = find('sql', 'org/sql-lora'); print(s.format, s.rank, s.path)"
    with LocalHub() as hub:
        files = {p.name: p.read_bytes() for p in adapters["b"].iterdir()} | {"README.md": b"# a LoRA"}
        hub.add("org/sql-lora", files)
        online = hub_env(hub, tmp_path)
        fetched = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=online)
        assert fetched.returncode == 0, fetched.stderr[-2000:]
        assert sorted(hub.fetched("org/sql-lora")) == ["adapter_config.json", "adapter_model.safetensors"]
    offline = hub_env(None, tmp_path, HF_HUB_OFFLINE="1")
    cached = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=offline)
    assert cached.returncode == 0 and cached.stdout == fetched.stdout, cached.stderr[-2000:]
    assert fetched.stdout.startswith("peft 4 ") and str(tmp_path) in fetched.stdout
