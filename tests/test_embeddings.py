"""/v1/embeddings: the decisions (the request, the model's pooling and sizes, the scheduler's plans for embedding
inputs) checked directly, and the official ``openai`` client against served models, whose vectors must equal
mlx-lm's own final hidden states pooled the same way, on one rank, two (split), and two pipeline stages."""

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
from conftest import Server, serving, wait_until
from test_scheduler import admitted, request, run, scheduler

from neuron.engine.intake import Intake
from neuron.engine.refusals import RequestError
from neuron.engine.scheduler import Scheduling
from neuron.engine.sequence import Sequence, StopText
from neuron.models.folder import Embedding, card_pooling, embedding
from neuron.sampling_params import NOT_ASKED, Sampled, SamplingParams
from neuron.server import embeddings
from neuron.server.common.errors import ApiError

# The decisions.


@pytest.mark.unit
@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("one text", ["one text"]),
        (["a", "b c"], ["a", "b c"]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5], [6, 7]], [[5], [6, 7]]),
    ],
    ids=["string", "strings", "token ids", "lists of token ids"],
)
def test_the_four_shapes_of_input_are_read_in_order(given: Any, inputs: list[Any]) -> None:
    asked = embeddings.parse({"model": "m", "input": given}, "m")
    assert asked.inputs == inputs
    assert (asked.encoding_format, asked.dimensions, asked.truncate, asked.add_special_tokens) == (
        "float",
        None,
        None,
        True,
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"input": "hi"}, 400, "model", "`model` is required"),
        ({"model": "other", "input": "hi"}, 404, "model", "does not exist"),
        ({"model": "m"}, 400, "input", "`input` is required"),
        ({"model": "m", "input": ""}, 400, "input", "is empty"),
        ({"model": "m", "input": ["a", ""]}, 400, "input[1]", "is empty"),
        ({"model": "m", "input": []}, 400, "input", "must be a string or an array of token ids"),
        ({"model": "m", "input": [[1], []]}, 400, "input[1]", "must be a string or an array of token ids"),
        ({"model": "m", "input": ["a"] * 2049}, 400, "input", "at most 2048 inputs"),
        ({"model": "m", "input": "a", "encoding_format": "int8"}, 400, "encoding_format", "float, base64"),
        ({"model": "m", "input": "a", "dimensions": 0}, 400, "dimensions", "at least 1"),
        ({"model": "m", "input": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "or -1"),
        ({"model": "m", "input": "a", "add_special_tokens": 1}, 400, "add_special_tokens", "a boolean"),
        ({"model": "m", "input": "a", "normalize": False}, 400, "normalize", "unrecognized request argument"),
        ({"model": "m", "input": "a", "user": {}}, 400, "user", "must be a string"),
    ],
)
def test_a_bad_request_names_its_field(body: dict[str, Any], status: int, param: str, words: str) -> None:
    with pytest.raises(ApiError) as refused:
        embeddings.parse(body, "m")
    assert (refused.value.status, refused.value.param) == (status, param)
    assert words in refused.value.message


@pytest.mark.unit
def test_dimensions_cut_only_a_model_trained_for_it() -> None:
    def check(dimensions: int, model: Embedding) -> None:
        embeddings.check_dimensions(embeddings.EmbeddingRequest(["a"], dimensions=dimensions), model, "m")

    plain = Embedding("MEAN", 256)
    check(256, plain)  # its own size asks for nothing
    with pytest.raises(ApiError, match=r'Model "m" does not support matryoshka representation.*send `dimensions` 256'):
        check(64, plain)
    with pytest.raises(ApiError, match="at most 256"):
        check(512, Embedding("MEAN", 256, None))
    check(7, Embedding("MEAN", 256, None))  # is_matryoshka: any size
    listed = Embedding("MEAN", 256, (64, 128))
    check(128, listed)
    with pytest.raises(ApiError, match="only supports 64, 128, 256 matryoshka dimensions"):
        check(100, listed)


@pytest.mark.unit
def test_a_cut_vector_is_of_unit_length_again() -> None:
    full = np.array([0.6, 0.0, 0.8], dtype="<f4").tobytes()
    assert embeddings.vector(full, None).tolist() == pytest.approx([0.6, 0.0, 0.8])
    assert embeddings.vector(full, 2).tolist() == [1.0, 0.0]


@pytest.mark.unit
def test_truncate_prompt_tokens_keeps_each_inputs_last_tokens_within_the_context() -> None:
    ids = list(range(10, 30))
    asked = embeddings.EmbeddingRequest([ids, [1, 2]], truncate=5)
    assert embeddings.prompts(asked, None, 100) == [ids[-5:], [1, 2]]
    whole = embeddings.EmbeddingRequest([ids], truncate=-1)
    assert embeddings.prompts(whole, None, 8) == [ids[-8:]]
    with pytest.raises(ApiError, match=r"\(50\) is more than the context holds \(8\)"):
        embeddings.prompts(embeddings.EmbeddingRequest([ids], truncate=50), None, 8)


@pytest.mark.unit
def test_an_input_longer_than_the_context_is_refused_naming_it_and_the_limit() -> None:
    intake = Intake(Scheduling(), context_length=8, vocab_size=100, eos_token_ids=frozenset({2}), tokenizer=None)
    first, second = intake.embeddings([[5] * 8, [6] * 3], "MEAN", "r")  # the whole context is allowed
    assert first.group == [second] and (first.pooling, second.max_tokens) == ("MEAN", 0)
    with pytest.raises(RequestError, match=r"`input\[1\]` has 9 tokens but this model embeds at most 8") as refused:
        intake.embeddings([[5], [6] * 9], "MEAN", "r")
    assert (refused.value.param, refused.value.code) == ("input[1]", "context_length_exceeded")
    with pytest.raises(RequestError, match=r"`input`: token ids must lie in \[0, 100\)"):
        intake.embeddings([[100]], "MEAN", "r")
    with pytest.raises(RequestError, match="holds no input"):
        intake.embeddings([], "MEAN", "r")


def _card(folder: Path, **modes: bool) -> Path:
    folder.mkdir()
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **modes}))
    return folder


@pytest.mark.unit
def test_the_pooling_is_the_settings_else_the_model_cards_else_the_mean(tmp_path: Path) -> None:
    last = _card(tmp_path / "qwen3-embedding", pooling_mode_lasttoken=True, pooling_mode_mean_tokens=False)
    mean = _card(tmp_path / "mean", pooling_mode_mean_tokens=True)
    cls = _card(tmp_path / "cls", pooling_mode_cls_token=True)  # no decoder is trained for it: not read
    assert (card_pooling(last), card_pooling(mean), card_pooling(cls), card_pooling(tmp_path)) == (
        "LAST",
        "MEAN",
        None,
        None,
    )
    config = {"hidden_size": 8}
    assert embedding(last, config, None) == Embedding("LAST", 8, ())
    assert embedding(last, config, "MEAN").pooling == "MEAN"
    assert embedding(tmp_path, config, None).pooling == "MEAN"
    assert embedding(tmp_path, {**config, "is_matryoshka": True}, None).cuts is None
    assert embedding(tmp_path, {**config, "matryoshka_dimensions": [2, 4]}, None).cuts == (2, 4)


@pytest.mark.unit
def test_whole_inputs_are_batched_by_length_so_that_padding_never_outweighs_the_tokens() -> None:
    from neuron.rank.embed import _groups
    from neuron.rpc import Prefill

    def chunk(seq: int, length: int, pool: str = "MEAN") -> Prefill:
        return Prefill(seq, 0, [5] * length, True, pool=pool)

    def lengths(groups: list[list[Prefill]]) -> list[list[int]]:
        return [[len(c.tokens) for c in group] for group in groups]

    assert lengths(_groups([chunk(i, 12) for i in range(8)])) == [[12] * 8]
    assert lengths(_groups([chunk(1, 500), *(chunk(i, 10 + i) for i in range(2, 6))])) == [[12, 13, 14, 15], [500]]
    assert lengths(_groups([chunk(1, 3), chunk(2, 4, "LAST"), chunk(3, 5)])) == [[4], [3, 5]]
    assert _groups([]) == []


def _inputs(*lengths: int) -> list[Sequence]:
    seqs = []
    for length in lengths:
        no = 1000 + len(seqs) + 10 * length
        seq = Sequence("e", no, list(range(3, 3 + length)), 0, SamplingParams(), StopText(()))
        seq.pooling = "LAST"
        seqs.append(seq)
    seqs[0].group = seqs[1:]
    return seqs


def _vector(no: int) -> Sampled:
    return Sampled(0, NOT_ASKED, embedding=np.array([float(no)], dtype="<f4").tobytes())


@pytest.mark.unit
def test_an_embedding_request_passes_a_generation_waiting_for_a_place_and_feeds_within_the_budget() -> None:
    s = scheduler(max_batch=1, prefill_chunk=8)
    running = request(3)
    admitted(s, running)
    run(s)  # its prompt is fed: it decodes from now on
    waiting = request(2)
    short, long = _inputs(3, 12)
    s.queues.add(waiting)
    s.queues.add(short)
    turn = s.schedule()
    assert turn.admitted == [short, long] and list(s.waiting) == [waiting]
    step = turn.step
    assert step is not None and set(step.starts) == set()  # no sampler for an input
    plan = step.plan
    assert [(c.seq, c.position, len(c.tokens), c.last, c.pool) for c in plan.prefill] == [
        (short.no, 0, 3, True, "LAST"),
        (long.no, 0, 5, False, "LAST"),
    ]
    assert [row.seq for row in plan.decode] == [running.no]  # the generation decodes in the same step
    delivered = s.update(step, {running.no: Sampled(7, NOT_ASKED), short.no: _vector(short.no)}, 1.0)
    assert [(d.seq, d.finish, d.sampled.embedding) for d in delivered if d.seq is short] == [
        (short, "stop", _vector(short.no).embedding)
    ]
    plan = run(s)
    assert plan.leave == [] and [(c.seq, c.position, c.last) for c in plan.prefill] == [(long.no, 5, True)]
    assert s.filling == [] and s.running == [running] and plan.save == []


@pytest.mark.unit
def test_an_input_cancelled_half_fed_leaves_every_rank_in_the_next_plan() -> None:
    s = scheduler(prefill_chunk=4)
    (seq,) = _inputs(10)
    s.queues.add(seq)
    run(s)
    s.queues.cancel(seq)
    turn = s.schedule()
    assert [dropped for dropped, _ in turn.cancelled] == [seq]
    assert turn.step is None and turn.clear  # alone: one clear drops it on every rank


@pytest.mark.unit
def test_a_failure_reaches_every_input_of_a_queued_request() -> None:
    s = scheduler(max_batch=1)
    first, second = _inputs(2, 2)
    s.queues.add(first)
    assert s.queues.clear() == [first, second]


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
