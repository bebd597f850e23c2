"""Hostile HTTP input: schemathesis against the served schema, and clients that stall or vanish.

The hand-written table of nasty bodies is ``BAD_REQUESTS`` in testkit/bad_requests.py.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from testkit import Server, serving_side_by_side, tcp_sockets, wait_until
from testkit.fuzzing import KEY, run_schemathesis

EXAMPLES = 10  # per operation, for the fuzzing phase; bench/http_fuzz.py runs longer, stateful too
# Tokens a reply of the fuzzed server generates at most (--max-completion-tokens): most schema-valid completions
# the coverage phase sends leave max_tokens out (OpenAI's default then), and decoding them, not parsing the
# refused, was most of the run. Two tokens still take a prefill and a decode step: every reply reaches the model,
# streams in more than one chunk and ends by its length or a stop.
REPLY_TOKENS = 2


@pytest.fixture(scope="module")
def servers(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """The module's two servers, started side by side: the fuzzed one, whose short context and short replies
    bound each generated request, so that thousands fit in a minute; and a roomy one, with the model's whole
    context, whose streams are long enough to be still running when their clients leave."""
    model = ("--model", str(tiny_models["qwen3"]))
    fuzzed = (*model, "--max-context", "64", "--max-completion-tokens", str(REPLY_TOKENS))
    with serving_side_by_side(tmp_path_factory, fuzzed, model, api_key=KEY) as started:
        yield started


@pytest.fixture(scope="module")
def fuzzed(servers: list[Server]) -> Server:
    return servers[0]


def test_schema_states_this_servers_model_and_limits(fuzzed: Server) -> None:
    document = httpx.get(f"{fuzzed.url}/openapi.json").json()
    chat = document["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["model"]["enum"] == ["qwen3"]
    assert chat["security"] == [{"bearer": []}, {"basic": []}]
    prompt = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    tokens = prompt["properties"]["prompt"]["anyOf"][1]
    assert tokens["maxItems"] == 63 and tokens["items"]["maximum"] == 258  # context 64, vocabulary 259
    assert document["paths"]["/health"]["get"]["security"] == []


def test_schemathesis_finds_no_server_error_and_no_schema_violation(fuzzed: Server) -> None:
    result = run_schemathesis(fuzzed.url, EXAMPLES, seed=1)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    served = [e for e in fuzzed.logs() if e.get("event") == "request done"]
    refused = [e for e in fuzzed.logs() if e.get("event") == "request refused"]
    # It must have reached the model, not only the parser, and the parser must have been tried hard.
    assert len(served) >= 50 and len(refused) >= 200, (len(served), len(refused))
    assert not [e for e in fuzzed.logs() if e.get("level") == "error"]


def _raw_post(url: str, body: bytes, length: int) -> socket.socket:
    """A chat request written straight to a socket, claiming ``length`` bytes of body; nothing is ever read."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: {length}\r\n\r\n".encode()
        + body
    )
    return s


@pytest.fixture(scope="module")
def roomy(servers: list[Server]) -> Server:
    return servers[1]


def test_stalled_and_abandoned_clients_cost_nothing_once_gone(roomy: Server) -> None:
    baseline = len([s for s in tcp_sockets(roomy.process.pid) if s[2] == "ESTABLISHED"])
    stalled = [_raw_post(roomy.url, b'{"model": ', 1000) for _ in range(20)]  # 10 of 1000 bytes, then silence
    # ignore_eos: the random model samples its end-of-sequence token now and then, and a stream that ended on its own
    # before its client left is one cancellation short ("assert 5 == 6", once, under load).
    chat = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1900, "stream": True}
    chat["ignore_eos"] = True
    body = orjson.dumps(chat)
    unread = [_raw_post(roomy.url, body, len(body)) for _ in range(6)]  # 6 of the batch's 8 places

    def running(count: int) -> Callable[[], bool]:
        def check() -> bool:
            m = roomy.metrics()
            return m[("neuron_requests_running", ())] == count and m[("neuron_requests_waiting", ())] == 0

        return check

    wait_until(running(6), 30, "the 6 streams running")
    # Stalled clients hold no step hostage: a polite request still gets through.
    polite = httpx.post(
        f"{roomy.url}/v1/completions",
        json={"model": "qwen3", "prompt": "x", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert polite.status_code == 200, polite.text
    for client in stalled + unread:
        client.close()
    # The streams are dropped at a step boundary, not run to their 1900 tokens.
    wait_until(running(0), 30, "every abandoned request dropped")
    assert len([e for e in roomy.logs() if e.get("event") == "request cancelled"]) == 6

    def disconnected() -> bool:
        return len([s for s in tcp_sockets(roomy.process.pid) if s[2] == "ESTABLISHED"]) <= baseline

    wait_until(disconnected, 30, "every connection closed")
