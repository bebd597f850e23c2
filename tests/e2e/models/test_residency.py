"""Which models stay loaded (issue 63): ``--models-max 1`` with requests alternating between two models swaps them
each time, every answer as it was alone; a model is never unloaded under a stream, the other model's request
waiting for it instead; a request's ``keep_alive`` (Ollama's field) unloads its model once it has idled that
long. Swaps and states are in /metrics. The decisions: tests/unit/router/test_residency.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from testkit import Server, serving, sse_events
from testkit.testbed import children

USER = {"authorization": "Bearer user-key"}
ADMIN = {"authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def router(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"keys": [{"name": "user", "key": "user-key"}, {"name": "ops", "key": "admin-key",
                                                                              "admin": True}]}))  # fmt: skip
    keys.chmod(0o600)
    models = ("--model", str(tiny_models["qwen3"]), "--model", str(tiny_models["llama"]), "--api-keys-file", str(keys))
    # No drain: a model's server stopped under a stream would cut it at once, rather than let it finish.
    # One request may wait for a model to load: those past it are told to come back.
    args = (*models, "--models-max", "1", "--speculate", "off", "--drain-timeout", "0", "--max-waiting", "1")
    with serving(tmp_path_factory, *args) as started:
        yield started


def _complete(router: Server, model: str, **extra: object) -> str:
    body = {"model": model, "prompt": "The lamp", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **extra}
    reply = httpx.post(f"{router.url}/v1/completions", json=body, headers=USER, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def _loaded(router: Server) -> list[str]:
    listed = httpx.get(f"{router.url}/v1/models", headers=USER).json()["data"]
    return [entry["id"] for entry in listed if entry["status"]["value"] == "loaded"]


def _last(router: Server, event: str, **fields: object) -> dict:
    found = [e for e in router.logs() if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())]
    assert found, (event, fields)
    return found[-1]


def _metric(router: Server, name: str, **labels: str) -> float:
    return router.metrics()[(name, tuple(sorted(labels.items())))]


def test_alternating_requests_under_a_cap_of_one_swap_every_time_and_answer_alike(router: Server) -> None:
    first = {model: _complete(router, model) for model in ("qwen3", "llama")}
    swaps = _metric(router, "neuron_model_swaps_total")
    for model in ("qwen3", "llama", "qwen3", "llama"):
        assert _complete(router, model) == first[model]
        assert _loaded(router) == [model]
    assert _metric(router, "neuron_model_swaps_total") == swaps + 4
    assert _metric(router, "neuron_model_state", model="qwen3", state="unloaded") == 1
    assert router.find_log("model state", model="qwen3", state="unloaded", why="least recently used: room for llama")


def test_a_model_is_never_unloaded_under_a_stream_the_other_waits_for_it(router: Server) -> None:
    _complete(router, "qwen3")
    body = {"model": "qwen3", "prompt": "The lamp", "max_tokens": 400, "temperature": 0.0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    finishes: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=USER, timeout=120) as reply:
            for event in sse_events(reply):
                if isinstance(event, dict):
                    finishes.extend(c["finish_reason"] for c in event["choices"] if c["finish_reason"])
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    other = _complete(router, "llama")  # waits for the stream to end, then swaps
    reader.join(120)
    assert other
    assert finishes == ["length"]  # the stream ended whole, all its tokens out, not cut by the swap
    unloaded = _last(router, "model state", model="qwen3", state="unloaded")
    ended = _last(router, "request done", model="qwen3", completion_tokens=400)
    assert ended["timestamp"] < unloaded["timestamp"]


def test_a_requests_keep_alive_unloads_its_model_once_idle_that_long(router: Server) -> None:
    body = {"model": "llama", "prompt": "The lamp", "max_tokens": 2, "keep_alive": "later"}
    refused = httpx.post(f"{router.url}/v1/completions", json=body, headers=USER, timeout=60)
    assert refused.status_code == 400 and "keep_alive must be seconds" in refused.json()["error"]["message"]
    _complete(router, "llama", keep_alive="1s")
    router.wait_log("model state", 30, model="llama", state="unloaded", why="idle for its keep_alive (1 s)")
    assert _loaded(router) == []


def test_the_keys_guard_every_model_and_the_admin_routes_take_only_an_admin_key(router: Server) -> None:
    body = {"model": "qwen3", "prompt": "The lamp", "max_tokens": 2}
    assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).status_code == 401
    assert httpx.get(f"{router.url}/v1/models", timeout=60).status_code == 401
    refused = httpx.post(f"{router.url}/models/unload", json={"model": "qwen3"}, headers=USER, timeout=60)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_needs_key"
    allowed = httpx.post(f"{router.url}/models/load", json={"model": "qwen3"}, headers=ADMIN, timeout=60)
    assert allowed.status_code == 200 and allowed.json()["status"]["value"] == "loaded"


def test_requests_past_max_waiting_for_a_loading_model_are_told_to_come_back(router: Server) -> None:
    httpx.post(f"{router.url}/models/unload", json={"model": "llama"}, headers=ADMIN, timeout=60).raise_for_status()
    body = {"model": "llama", "prompt": "The lamp", "max_tokens": 2}

    def ask(_: int) -> httpx.Response:
        return httpx.post(f"{router.url}/v1/completions", json=body, headers=USER, timeout=120)

    with ThreadPoolExecutor(3) as pool:  # all three sent while the model loads, which takes a second or more
        replies = list(pool.map(ask, range(3)))
    statuses = sorted(reply.status_code for reply in replies)
    assert statuses[0] == 200 and statuses[-1] == 503, [reply.text for reply in replies]
    crowded = next(reply for reply in replies if reply.status_code == 503)
    assert crowded.json()["error"]["code"] == "model_queue_full" and crowded.headers["retry-after"]


def test_a_model_server_that_dies_mid_stream_ends_the_stream_with_an_error_and_loads_again(router: Server) -> None:
    """One model's server process killed under a stream: the stream ends with an error event the client reads,
    not a cut connection; the router and the other model go on, and the next request loads the model again."""
    _complete(router, "qwen3")
    body = {"model": "qwen3", "prompt": "The lamp", "max_tokens": 400, "ignore_eos": True, "stream": True}
    errors: list[dict] = []
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=USER, timeout=120) as reply:
        events = sse_events(reply)
        next(events)
        (server,) = [
            pid for pid in children(router.process.pid) if b"qwen3" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        os.kill(server, signal.SIGKILL)
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == "model_server_lost", errors
    router.wait_log("model state", 30, model="qwen3", state="failed")  # its exit seen
    assert _complete(router, "llama") and _complete(router, "qwen3")  # the other goes on; this one loads again
