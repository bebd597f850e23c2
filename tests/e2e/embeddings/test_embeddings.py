"""/v1/embeddings end to end: the official ``openai`` client against served models, whose vectors must equal
mlx-lm's own final hidden states pooled the same way, on one rank, two (split), and two pipeline stages; beside
streaming generations, and with a client that leaves. The decisions behind it: tests/unit/server/
test_embeddings.py."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from testkit import Server, serving, wait_until

# The served model.


@pytest.fixture(scope="module")
def model_path(thinking_server: Server) -> Path:
    return Path(thinking_server.args[thinking_server.args.index("--model") + 1])


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Any:
    """mlx-lm's own computation of an embedding: the model's final hidden states (its inner model's output, the
    final norm applied), pooled, scaled to unit length."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(model_path))

    def embed(ids: list[int], pooling: str = "MEAN") -> np.ndarray:
        states = model.model(mx.array([ids]))[0].astype(mx.float32)
        pooled = states.mean(axis=0) if pooling == "MEAN" else states[-1]
        return np.array(pooled / mx.linalg.norm(pooled))

    embed.tokenizer = tokenizer  # type: ignore[attr-defined]
    return embed


LONG = "The quick brown fox jumps over the lazy dog; " * 5  # 225 tokens: fed over four steps of 64


def _client(server: Server) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_the_openai_client_gets_mlx_lms_vectors_in_order_as_floats_and_base64(
    thinking_server: Server, reference: Any
) -> None:
    client = _client(thinking_server)
    # The first two are fed together, left-padded in one forward; the long one over four steps; the last alone.
    texts = ["hello", "two dogs", LONG, "héllo wörld"]
    floats = client.embeddings.create(model="tiny-thinker", input=texts, encoding_format="float")
    assert [item.index for item in floats.data] == [0, 1, 2, 3] and floats.object == "list"
    ids = [reference.tokenizer.encode(text) for text in texts]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    for item, tokens in zip(floats.data, ids, strict=True):
        assert len(item.embedding) == 256
        assert np.abs(np.array(item.embedding) - reference(tokens)).max() < 1e-4
    # The client's own default asks for base64, and decodes it: the very same float32 values.
    packed = client.embeddings.create(model="tiny-thinker", input=texts)
    for item, plain in zip(packed.data, floats.data, strict=True):
        assert np.array_equal(np.array(item.embedding, dtype=np.float32), np.array(plain.embedding, dtype=np.float32))
    # Token ids, and base64 as sent (float32, little-endian): the same values again.
    raw = httpx.post(
        f"{thinking_server.url}/v1/embeddings",
        json={"model": "tiny-thinker", "input": ids, "encoding_format": "base64"},
        timeout=30,
    ).json()
    assert [item["index"] for item in raw["data"]] == [0, 1, 2, 3]
    for item, plain in zip(raw["data"], floats.data, strict=True):
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert np.array_equal(decoded, np.array(plain.embedding, dtype=np.float32))
    # In another order, each input's vector comes back at its own index (the chunks fall elsewhere: nearly equal).
    turned = client.embeddings.create(model="tiny-thinker", input=texts[::-1], encoding_format="float")
    for item, plain in zip(turned.data[::-1], floats.data, strict=True):
        assert np.abs(np.array(item.embedding) - np.array(plain.embedding)).max() < 1e-6


def test_refusals_are_openai_errors_naming_the_limit(thinking_server: Server) -> None:
    from openai import BadRequestError

    client = _client(thinking_server)
    with pytest.raises(BadRequestError) as refused:
        client.embeddings.create(model="tiny-thinker", input=["fine", [5] * 2049])
    error = refused.value.body
    assert error["param"] == "input[1]" and error["code"] == "context_length_exceeded"  # type: ignore[index]
    assert "has 2049 tokens but this model embeds at most 2048" in error["message"]  # type: ignore[index]
    with pytest.raises(BadRequestError, match="does not support matryoshka representation"):
        client.embeddings.create(model="tiny-thinker", input="hi", dimensions=64)
    cut = client.embeddings.create(model="tiny-thinker", input=[5] * 2049, extra_body={"truncate_prompt_tokens": -1})
    assert cut.usage.prompt_tokens == 2048


STORIES = ["Once upon a time", "In a land far away", "The ship sailed", "Rain fell on"]


def _stream_text(server: Server, prompt: str, started: threading.Event | None = None) -> str:
    body = {"model": "tiny-thinker", "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    text = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line.removeprefix("data: "))["choices"][0]["text"])
                if started is not None:
                    started.set()
    return "".join(text)


def _four_streams(server: Server, started: threading.Event | None = None) -> list[str]:
    """Four greedy generations at once; each one's text."""
    texts: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: texts.update({i: _stream_text(server, STORIES[i], started)}))
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return [texts.get(i, "") for i in range(4)]


def _embed_while(server: Server, streaming: threading.Thread, inputs: list[Any]) -> list[np.ndarray]:
    client = _client(server)
    out = []
    while streaming.is_alive() or not out:
        reply = client.embeddings.create(model="tiny-thinker", input=inputs, encoding_format="float")
        out.append(np.array([item.embedding for item in reply.data]))
        assert streaming.is_alive() or len(out) > 1, "the generations ended before an embedding came back"
    return out


def test_embeddings_while_four_generations_stream_leave_them_and_themselves_unchanged(
    thinking_server: Server, reference: Any
) -> None:
    undisturbed = _four_streams(thinking_server)
    inputs = [LONG, "short one", [7, 8, 9]]
    once = _client(thinking_server).embeddings.create(model="tiny-thinker", input=inputs, encoding_format="float")
    alone = np.array([item.embedding for item in once.data])
    started, texts = threading.Event(), []
    streaming = threading.Thread(target=lambda: texts.append(_four_streams(thinking_server, started)))
    streaming.start()
    try:
        deadline = time.monotonic() + 60
        while not started.is_set():
            assert time.monotonic() < deadline, "the streams never started"
            started.wait(0.05)
        during = _embed_while(thinking_server, streaming, inputs)
    finally:
        streaming.join(150)
    assert texts == [undisturbed] and all(undisturbed)
    for vectors in during:
        assert np.abs(vectors - alone).max() < 1e-6
    assert np.abs(alone[2] - reference([7, 8, 9])).max() < 1e-4


def test_a_client_that_leaves_cancels_its_inputs_and_the_server_goes_on(
    thinking_server: Server, reference: Any
) -> None:
    def outcomes() -> dict[str, float]:
        scraped = thinking_server.metrics()
        return {o: scraped.get(("neuron_requests_total", (("outcome", o),)), 0.0) for o in ("stop", "cancelled")}

    before = outcomes()
    body = json.dumps({"model": "tiny-thinker", "input": [LONG] * 64}).encode()  # about 230 steps of 64 tokens
    # The client leaves once the first input is embedded, whatever the machine's speed (a fixed wait let a fast
    # server embed half of them first): most of the work is still ahead when it goes.
    with socket.create_connection(("127.0.0.1", thinking_server.port)) as client:
        head = "POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        client.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: outcomes()["stop"] > before["stop"], 60, "the first input embedded")
    # Each input ends once: embedded before the client left, or cancelled.
    wait_until(lambda: sum(outcomes().values()) - sum(before.values()) >= 64, 60, "every input to end")
    assert outcomes()["cancelled"] - before["cancelled"] > 32
    again = _client(thinking_server).embeddings.create(model="tiny-thinker", input=[5, 6], encoding_format="float")
    assert np.abs(np.array(again.data[0].embedding) - reference([5, 6])).max() < 1e-4
    assert thinking_server.find_log("desync") is None and thinking_server.find_log("not ready") is None


@pytest.fixture(
    scope="module",
    params=[("--tp", "2"), ("--pp", "2", "--pooling-type", "LAST")],
    ids=["tp2-mean", "pp2-last"],
)
def split(
    request: pytest.FixtureRequest, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The same model on two ranks: every layer sliced (mean pooling), and two pipeline stages (the last token)."""
    with serving(tmp_path_factory, "--model", str(model_path), "--prefill-chunk", "64", *request.param) as server:
        yield server


def test_two_ranks_give_one_ranks_vectors(split: Server, thinking_server: Server, reference: Any) -> None:
    pooling = "LAST" if "LAST" in split.args else "MEAN"
    texts = ["hello", "two dogs", LONG]
    got = _client(split).embeddings.create(model="tiny-thinker", input=texts, encoding_format="float")
    for item, text in zip(got.data, texts, strict=True):
        assert np.abs(np.array(item.embedding) - reference(reference.tokenizer.encode(text), pooling)).max() < 1e-5
    if pooling == "MEAN":
        one = _client(thinking_server).embeddings.create(model="tiny-thinker", input=texts, encoding_format="float")
        for mine, theirs in zip(got.data, one.data, strict=True):
            assert np.abs(np.array(mine.embedding) - np.array(theirs.embedding)).max() < 1e-5
