"""Request parsing through the real app, in process: the HTTP layer and the engine's intake, with an engine that
runs nothing. Every refusal a client can provoke, its status and its OpenAI error body, in milliseconds.

tests/e2e/serving/test_server.py sends the same table to a real server; this is where a parsing rule is checked
first.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from neuron.engine.intake import Intake
from neuron.engine.refusals import Overloaded, Unavailable
from neuron.engine.scheduler import Scheduling
from neuron.engine.sequence import Sequence
from neuron.engine.text import Text
from neuron.grammar import Grammars
from neuron.sampling_params import SamplingParams
from neuron.server.app import ServerState, build_app
from neuron.server.keys import load
from testkit import tokenizer_files
from testkit.bad_requests import BAD_REQUESTS, CHAT, COMPLETIONS, GOOD_CHAT

CONTEXT = 2048  # the tiny models' max_position_embeddings, as tests/e2e/serving/test_server.py's server has


@dataclass
class Health:
    ready: bool = True
    reason: str = "ready"


class StandInEngine:
    """What the HTTP layer reads of an engine, with the real intake behind ``submit``; no step ever runs."""

    def __init__(self, text: Text, limits: Scheduling) -> None:
        self.text = text
        self.limits = limits
        self.context_length = CONTEXT
        self.vocab_size = len(text.tokenizer._tokenizer)
        self.grammars = Grammars(text.tokenizer._tokenizer, self.vocab_size, sorted(text.eos_token_ids))
        self.intake = Intake(limits, CONTEXT, self.vocab_size, frozenset(text.eos_token_ids), text.tokenizer)
        self.health = Health()
        self.accepting = True
        self.vision = text.vision is not None
        self.refuse: Exception | None = None  # raised by the next submit, after intake's checks
        self.submitted: list[Sequence] = []
        self.cancelled: list[Sequence] = []
        self.adapters = SimpleNamespace(names=[])  # no LoRA adapter served

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        n: int = 1,
        adapter: str | None = None,
        priority: int = 0,
        trace: object = None,  # never given: no tracing here
        key: str | None = None,
    ) -> Sequence:
        seqs = self.intake.sequences(prompt, params, request_id, n)
        for seq in seqs:
            seq.priority, seq.key = priority, key
        self.submitted += seqs
        if self.refuse is not None:
            raise self.refuse
        return seqs[0]

    def cancel(self, seq: Sequence) -> None:
        self.cancelled.append(seq)


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Text:
    folder: Path = tmp_path_factory.mktemp("tokenizer")
    tokenizer_files(folder)
    return Text.load(folder)


@pytest.fixture
def engine(text: Text) -> StandInEngine:
    return StandInEngine(text, Scheduling())


@pytest.fixture
def client(engine: StandInEngine) -> Iterator[TestClient]:
    state = ServerState("qwen3", keys=load("secret", None), engine=engine)  # type: ignore[arg-type]
    with TestClient(build_app(state), raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
        yield client


def post(client: TestClient, path: str, body: object, key: str | None = "secret") -> Any:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers=headers)


@pytest.mark.parametrize(
    ("what", "path", "body", "key", "status", "param", "words"), BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS]
)
def test_bad_request_gets_its_status_and_an_openai_error_body(
    client: TestClient,
    engine: StandInEngine,
    what: str,
    path: str,
    body: object,
    key: str | None,
    status: int,
    param: str | None,
    words: str,
) -> None:
    response = post(client, path, body, key)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert "Traceback" not in response.text and "pydantic" not in response.text
    assert engine.submitted == []  # nothing refused ever queues


def test_an_over_long_prompt_names_both_lengths(client: TestClient) -> None:
    error = post(client, COMPLETIONS, {"model": "qwen3", "prompt": [5] * 2100}).json()["error"]
    assert "2100" in error["message"] and "2048" in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_a_refused_prompt_of_several_is_named_by_its_index(client: TestClient) -> None:
    error = post(client, COMPLETIONS, {"model": "qwen3", "prompt": ["fine", [5] * 2100]}).json()["error"]
    assert error["param"] == "prompt[1]"


def test_a_chat_prompt_refusal_names_the_messages(client: TestClient) -> None:
    error = post(client, CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": "x" * 2100}]}).json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"


def test_the_parsed_request_reaches_intake_with_its_settings(client: TestClient, engine: StandInEngine) -> None:
    """A good request queues: what the engine receives is the request as parsed, end-of-sequence ids added."""
    engine.refuse = Overloaded("the queue holds 64 requests (--max-waiting)")  # so that no reply is awaited
    body = {"model": "qwen3", "prompt": "hi", "max_tokens": 3, "temperature": 0.5, "stop": ["x"], "n": 2, "seed": 7}
    assert post(client, COMPLETIONS, body | {"priority": -3}).status_code == 429
    first, second = engine.submitted
    assert first.priority == second.priority == -3
    assert first.prompt == engine.text.encode("hi") and first.max_tokens == 3
    assert (first.params.temperature, first.params.stop, first.params.seed, second.params.seed) == (0.5, ("x",), 7, 8)
    assert set(engine.text.eos_token_ids) <= set(first.params.stop_token_ids)
    assert second.copy_of is first
    # The Responses and Messages bodies pass it on as the chat's.
    assert post(client, "/v1/responses", {"model": "qwen3", "input": "hi", "priority": 4}).status_code == 429
    assert post(client, "/v1/messages", {**GOOD_CHAT, "priority": -9}).status_code == 429
    assert [seq.priority for seq in engine.submitted[2:]] == [4, -9]


def test_a_request_carries_its_keys_name_and_no_sooner_priority_than_its_key_may_ask(
    engine: StandInEngine, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys.json"
    keys = [{"name": "people", "key": "p-secret"}, {"name": "agents", "key": "a-secret", "best_priority": 5}]
    keys_file.write_text(json.dumps({"keys": keys}))
    state = ServerState("qwen3", keys=load(None, str(keys_file)), engine=engine)  # type: ignore[arg-type]
    engine.refuse = Overloaded("the queue is full")  # so that no reply is awaited
    with TestClient(build_app(state), raise_server_exceptions=False, base_url="http://127.0.0.1") as c:
        soon = {"model": "qwen3", "prompt": "hi", "priority": 4}
        refused = post(c, COMPLETIONS, soon, key="a-secret")
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == ("priority", "priority_not_allowed")
        assert "'agents'" in error["message"] and "give 5 or more" in error["message"]
        assert engine.submitted == []
        assert post(c, COMPLETIONS, soon | {"priority": 5}, key="a-secret").status_code == 429
        assert post(c, CHAT, {**GOOD_CHAT, "priority": -100}, key="p-secret").status_code == 429  # no bound
        assert post(c, COMPLETIONS, soon, key="nobody").status_code == 401
    assert [(seq.key, seq.priority) for seq in engine.submitted] == [("agents", 5), ("people", -100)]


def test_a_full_queue_answers_429_with_retry_after_and_cancels_what_queued(
    client: TestClient, engine: StandInEngine
) -> None:
    engine.refuse = Overloaded("the queue holds 64 requests (--max-waiting)")
    response = post(client, COMPLETIONS, {"model": "qwen3", "prompt": ["a", "b"]})
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "queue_full"
    assert engine.cancelled == []  # the first prompt's refusal left nothing queued to cancel


def test_an_unavailable_engine_answers_503_with_its_retry_after(client: TestClient, engine: StandInEngine) -> None:
    engine.refuse = Unavailable("not ready: rank 1 lost", retry_after=5)
    response = post(client, CHAT, GOOD_CHAT)
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert "rank 1 lost" in response.json()["error"]["message"]


def test_unknown_paths_and_methods_get_openai_errors(client: TestClient) -> None:
    missing = client.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong_method = client.get(CHAT)
    assert wrong_method.status_code == 405 and "POST" in wrong_method.headers["allow"]
    assert client.get("/v1/models").status_code == 401
    listed = client.get("/v1/models", headers={"authorization": "Bearer secret"}).json()
    assert [m["id"] for m in listed["data"]] == ["qwen3"]
    assert client.get("/v1/models/gpt-9", headers={"authorization": "Bearer secret"}).status_code == 404


def test_ready_follows_the_engine(client: TestClient, engine: StandInEngine) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready", "model": "qwen3"}
    engine.health = Health(False, "rank 1 lost")
    assert client.get("/ready").status_code == 503 and "rank 1 lost" in client.get("/ready").text
    engine.accepting = False
    assert "shutting down" in client.get("/ready").json()["error"]["message"]


def test_a_loading_server_answers_503_naming_what_it_waits_for(text: Text) -> None:
    state = ServerState("qwen3", status="loading the model")
    with TestClient(build_app(state), base_url="http://127.0.0.1") as client:
        response = client.post(CHAT, json=GOOD_CHAT)
        assert response.status_code == 503 and "loading the model" in response.json()["error"]["message"]
        assert client.get("/ready").status_code == 503
