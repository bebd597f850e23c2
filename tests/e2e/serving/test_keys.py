"""API keys with names (``--api-keys-file``), on a real server: one key keeps 16 requests in flight while another
sends one at a time, and the light key's median time to first token stays within a few times its time alone (its fair
share of the batch: a request of the heavy key steps out for it, and resumes with the text it gets alone); each
key's usage is in ``/metrics``; a key over its share of the queue gets 429 while the other is served. The
decisions are tests/unit/engine/test_fairness.py's; the key checks tests/unit/server/test_keys.py's."""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit import Server, serving, sse_events, wait_until

PEOPLE, AGENTS = "people-secret", "agents-secret"
KEYS = {"keys": [{"name": "people", "key": PEOPLE, "admin": True}, {"name": "agents", "key": AGENTS}]}
BATCH = 4
HEAVY_IN_FLIGHT = 16
HEAVY, HEAVY_TOKENS = "The keeper climbs the stairs at dusk", 48
LIGHT, LIGHT_TOKENS = "Is the lamp lit?", 2
ROUNDS = 7


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys_file = tmp_path_factory.mktemp("keys") / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    keys_file.chmod(0o600)
    # Speculation off: one token a step for every stream, so that the heavy ones hold their places for long.
    args = ("--api-keys-file", str(keys_file), "--max-batch", str(BATCH), "--max-waiting", "32", "--speculate", "off")
    with serving(tmp_path_factory, "--model", str(tiny_models["qwen3"]), *args) as started:
        yield started


def _body(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": "qwen3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def _complete(client: httpx.Client, key: str, prompt: str, max_tokens: int) -> httpx.Response:
    return client.post("/v1/completions", json=_body(prompt, max_tokens), headers={"authorization": f"Bearer {key}"})


def _first_token_s(client: httpx.Client) -> float:
    """The light key's time to first token, as its client sees it: sent to the first text streamed."""
    started = time.perf_counter()
    body = _body(LIGHT, LIGHT_TOKENS) | {"stream": True}
    with client.stream("POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {PEOPLE}"}) as reply:
        assert reply.status_code == 200, reply.read()
        events = sse_events(reply)
        first = next(events)
        waited = time.perf_counter() - started
        assert isinstance(first, dict) and first["choices"][0]["text"], first
        for _ in events:
            pass
    return waited


class Heavy:
    """The heavy key: ``HEAVY_IN_FLIGHT`` clients, each sending its next request as its last one ends."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.stop = threading.Event()
        self.texts: list[str] = []
        self.refused: list[httpx.Response] = []
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(HEAVY_IN_FLIGHT)]

    def client(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=120) as client:
            while not self.stop.is_set():
                reply = _complete(client, AGENTS, HEAVY, HEAVY_TOKENS)
                if reply.status_code == 200:
                    self.texts.append(reply.json()["choices"][0]["text"])
                else:
                    self.refused.append(reply)
                    self.stop.wait(float(reply.headers.get("retry-after", "1")))

    def __enter__(self) -> Heavy:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


def _in_flight(server: Server) -> float:
    metrics = server.metrics()
    return metrics[("neuron_requests_running", ())] + metrics[("neuron_requests_waiting", ())]


def test_a_light_key_keeps_its_time_to_first_token_beside_a_key_with_sixteen_in_flight(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        alone_text = _complete(client, AGENTS, HEAVY, HEAVY_TOKENS).json()["choices"][0]["text"]
        alone = statistics.median(_first_token_s(client) for _ in range(ROUNDS))
        with Heavy(server) as heavy:
            wait_until(lambda: _in_flight(server) >= HEAVY_IN_FLIGHT, 60, "the heavy key's 16 requests in flight")
            shared = statistics.median(_first_token_s(client) for _ in range(ROUNDS))
        assert heavy.texts and not heavy.refused, [r.text for r in heavy.refused]
    print(
        f"light key's median time to first token: alone {alone * 1e3:.1f} ms, beside 16 in flight {shared * 1e3:.1f} ms"
    )
    # The issue asks for twice the time alone: bench/fair_share.py measures it with the heavy key's clients in a
    # process of their own, as another key's would be. Here they are sixteen threads beside the light client's, whose
    # own first token waits on their Python too, and the step that feeds the light prompt beside the heavy rows runs
    # two forwards (its prompt's and their decode rows'): near 2.5 times. Without the fair share it waits for the
    # heavy key's queue, a hundred times and more.
    assert shared <= 4 * alone, (alone, shared)
    # Every heavy request, those that stepped out for the light key's too, ends with the text it gets alone.
    assert set(heavy.texts) == {alone_text}
    metrics = server.metrics()
    assert metrics[("neuron_num_preemptions_total", (("reason", "fair_share"),))] >= 1
    ended = len(heavy.texts) + 1
    assert metrics[("neuron_key_requests_total", (("key", "agents"), ("outcome", "length")))] == ended
    assert metrics[("neuron_key_completion_tokens_total", (("key", "agents"),))] == ended * HEAVY_TOKENS
    assert metrics[("neuron_key_requests_total", (("key", "people"), ("outcome", "length")))] == 2 * ROUNDS
    assert metrics[("neuron_key_completion_tokens_total", (("key", "people"),))] == 2 * ROUNDS * LIGHT_TOKENS
    assert metrics[("neuron_key_prompt_tokens_total", (("key", "people"),))] > 0


def test_a_key_over_its_share_of_the_queue_gets_429_while_the_other_is_served(server: Server) -> None:
    """32 places in the queue: while both keys have requests in flight, each may have 16 waiting. The heavy key's
    clients, 32 of them now, are refused past its share with Retry-After (and served as they retry), while the light
    key's long stream and its next request are answered."""
    light: list[str] = []
    streaming = threading.Event()

    def long_light() -> None:  # the light key's request in flight while the heavy key bursts
        body = _body(LIGHT, 4 * HEAVY_TOKENS) | {"stream": True}
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, headers={"authorization": f"Bearer {PEOPLE}"}
        ) as reply:
            for event in sse_events(reply):
                streaming.set()
                if isinstance(event, dict) and event["choices"][0]["finish_reason"]:
                    light.append(event["choices"][0]["finish_reason"])

    with Heavy(server) as heavy, httpx.Client(base_url=server.url, timeout=120) as client:
        wait_until(lambda: _in_flight(server) >= HEAVY_IN_FLIGHT, 60, "the heavy key's 16 requests in flight")
        holding = threading.Thread(target=long_light)
        holding.start()
        assert streaming.wait(60), "the light key's long request did not start"
        with Heavy(server) as burst:  # 16 more: past the heavy key's 16 waiting
            wait_until(lambda: bool(burst.refused), 60, "a refusal of the heavy key's burst")
            assert _first_token_s(client) > 0  # the light key is served all the same
        holding.join(timeout=120)
    refusal = burst.refused[0]
    assert refusal.status_code == 429 and refusal.headers["retry-after"] == "1"
    message = refusal.json()["error"]["message"]
    waiting = re.search(r"API key 'agents' has (\d+) requests waiting, its share of the queue's 32 places", message)
    assert waiting is not None and int(waiting[1]) >= 16, message
    assert light == ["length"]  # the light key's long stream ended whole
    assert heavy.texts and burst.texts  # a refused client's retry is served as a place frees
    metrics = server.metrics()
    assert metrics[("neuron_key_requests_total", (("key", "agents"), ("outcome", "rejected")))] >= 1
    assert ("neuron_key_requests_total", (("key", "people"), ("outcome", "rejected"))) not in metrics
