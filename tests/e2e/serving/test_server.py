"""`neuron serve` end to end: a real server subprocess, real workers, the official openai client."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from testkit import ROOT, Server, faults, run_neuron, serving, sse_events, wait_until
from testkit.bad_requests import BAD_REQUESTS, CHAT, COMPLETIONS, GOOD_CHAT
from testkit.server import PARIS, sigterm_mid_stream

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tp1(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory, "--model", str(tiny_models["qwen3"])) as server:
        yield server


@pytest.fixture(scope="module")
def tp2(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory, "--model", str(tiny_models["qwen3"]), "--tp", "2") as server:
        yield server


@pytest.fixture(params=["tp1", "tp2"])
def server(request: pytest.FixtureRequest) -> Server:
    return request.getfixturevalue(request.param)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "none", max_retries=0)


def complete(server: Server, prompt: str = "hello", **kwargs: object) -> openai.types.Completion:
    args = {"max_tokens": 32, "temperature": 0.0, **kwargs}
    return client(server).completions.create(model="qwen3", prompt=prompt, **args)  # type: ignore[call-overload]


def _chat_prompt_tokens(tokenizer: AutoTokenizer, messages: list[dict[str, str]]) -> int:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return len(encoded["input_ids"])


def test_models_list(server: Server) -> None:
    models = client(server).models.list().data
    assert [m.id for m in models] == ["qwen3"]
    assert client(server).models.retrieve("qwen3").id == "qwen3"


def test_chat_whole_and_streamed_agree_with_usage_and_logprobs(server: Server, tiny_models: dict[str, Path]) -> None:
    args = {"model": "qwen3", "messages": MESSAGES, "temperature": 0.0, "max_tokens": 24}
    whole = client(server).chat.completions.create(**args, logprobs=True, top_logprobs=3)  # type: ignore[call-overload]
    choice = whole.choices[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    prompt_tokens = _chat_prompt_tokens(tokenizer, MESSAGES)
    assert whole.usage.prompt_tokens == prompt_tokens
    content = choice.logprobs.content
    assert whole.usage.completion_tokens == len(content) > 0
    assert whole.usage.total_tokens == prompt_tokens + len(content)
    assert choice.finish_reason in ("stop", "length")
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 3
        alternatives = [t.logprob for t in entry.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        assert entry.logprob == alternatives[0]  # greedy picks the most likely token

    stream = client(server).chat.completions.create(**args, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    streamed = chunks[-1].usage
    assert chunks[-1].choices == [] and streamed is not None
    assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.total_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
        whole.usage.total_tokens,
    )
    # The same prompt again: all of it but the last token comes from the prefix cache the first request filled.
    assert streamed.prompt_tokens_details.cached_tokens == prompt_tokens - 1


@pytest.mark.anyio
async def test_async_client_streams_the_same_text(server: Server) -> None:
    expected = complete(server).choices[0].text
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as aclient:
        stream = await aclient.completions.create(
            model="qwen3", prompt="hello", max_tokens=32, temperature=0.0, stream=True
        )
        text = "".join([chunk.choices[0].text async for chunk in stream])
    assert text == expected


def test_greedy_over_http_equals_neuron_generate_and_tp1(
    tp1: Server, tp2: Server, tiny_models: dict[str, Path]
) -> None:
    http1, http2 = complete(tp1).choices[0].text, complete(tp2).choices[0].text
    cli = run_neuron("generate", "--model", str(tiny_models["qwen3"]), "--max-tokens", "32", "hello")
    assert cli.returncode == 0, cli.stderr
    assert len(set(http1)) > 4
    assert http1 == http2 == cli.stdout.removesuffix("\n")


def test_stop_strings_are_never_emitted(tp1: Server) -> None:
    text = complete(tp1, max_tokens=48).choices[0].text
    start = next(i for i in range(8, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    stop = text[start : start + 3]  # three byte-tokens: the stop string arrives split across steps
    expected = text[: text.index(stop)]
    whole = complete(tp1, max_tokens=48, stop=[stop, "never-seen"])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop")
    pieces = [c.choices[0].text for c in complete(tp1, max_tokens=48, stop=stop, stream=True)]
    assert "".join(pieces) == expected


def test_seeded_sampling_is_reproducible(tp1: Server) -> None:
    args = {"temperature": 1.0, "top_p": 0.95, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    first, again = (complete(tp1, seed=7, **args).choices[0].text for _ in range(2))
    other = complete(tp1, seed=8, **args).choices[0].text
    assert first == again
    assert first != other


def test_extension_sampling_fields_and_logit_bias(tp1: Server) -> None:
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3}
    assert complete(tp1, temperature=0.7, seed=1, extra_body=extra).choices[0].text
    forced = complete(tp1, max_tokens=8, logprobs=1, logit_bias={"100": 100})
    assert forced.choices[0].logprobs.tokens == [forced.choices[0].logprobs.tokens[0]] * 8


def test_a_top_k_past_the_vocabulary_keeps_every_token_and_neutral_values_are_accepted(tp1: Server) -> None:
    # A k this large once failed the step inside mlx-lm's top-k (schemathesis found it).
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "best_of": 1}
    same = [
        complete(tp1, temperature=1.0, seed=3, extra_body={"top_k": k, **neutral}).choices[0].text for k in (0, 10**9)
    ]
    assert same[0] == same[1]


def test_disconnect_drops_the_request_at_the_next_step_boundary(tp2: Server) -> None:
    reference = complete(tp2).choices[0].text
    body = {"model": "qwen3", "prompt": "hello", "max_tokens": 1900, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{tp2.url}/v1/completions", json=body, timeout=60) as response:
        events = sse_events(response)
        first = next(events)
        for _ in range(3):
            next(events)
    cancelled = tp2.wait_log("request cancelled", request_id=first["id"], timeout=30)
    assert cancelled["steps_after_cancel"] <= 1  # the step in flight finishes; no other starts
    assert cancelled["completion_tokens"] < 1900
    assert complete(tp2).choices[0].text == reference

    # A client that stops waiting for a whole (non-streamed) answer is dropped the same way.
    before = sum(e.get("event") == "request cancelled" for e in tp2.logs())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tp2.url}/v1/completions", json={**body, "stream": False}, timeout=1.0)
    wait_until(
        lambda: sum(e.get("event") == "request cancelled" for e in tp2.logs()) > before, 30, "the dropped request"
    )
    assert complete(tp2).choices[0].text == reference


def test_full_queue_answers_429_and_a_cancelled_wait_frees_its_place(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # One in the batch, one waiting: the third finds the queue full.
    args = ("--model", str(tiny_models["qwen3"]), "--max-batch", "1", "--max-waiting", "1")
    with serving(tmp_path_factory, *args) as server:
        body = {"model": "qwen3", "prompt": "hello", "max_tokens": 1900, "temperature": 0.0, "stream": True}
        url = f"{server.url}/v1/completions"
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", url, json=body) as running:
                # Held in a name: a generator dropped at once is closed, and it closes the connection with it.
                events = sse_events(running)
                next(events)  # the engine is generating it
                with http.stream("POST", url, json=body) as waiting:
                    assert waiting.status_code == 200
                    full = http.post(url, json=body)
                    assert full.status_code == 429 and full.headers["retry-after"]
                    assert full.json()["error"]["code"] == "queue_full"

                def accepted(url: str = url, body: dict = body) -> bool:
                    with http.stream("POST", url, json=body) as attempt:
                        return attempt.status_code == 200

                wait_until(accepted, 30, "the cancelled waiter's place to free up")


def _post(server: Server, path: str, body: object, key: str | None = "secret", **kwargs: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def keyed(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory, "--model", str(tiny_models["qwen3"]), api_key="secret") as server:
        yield server


@pytest.mark.parametrize(
    ("what", "path", "body", "key", "status", "param", "words"), BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS]
)
def test_bad_request_gets_its_status_and_an_openai_error_body(
    keyed: Server, what: str, path: str, body: object, key: str | None, status: int, param: str | None, words: str
) -> None:
    response = _post(keyed, path, body, key)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert "Traceback" not in response.text and "pydantic" not in response.text


def test_over_long_prompt_names_both_lengths(keyed: Server) -> None:
    error = _post(keyed, COMPLETIONS, {"model": "qwen3", "prompt": [5] * 2100}).json()["error"]
    assert "2100" in error["message"] and "2048" in error["message"]


def test_unknown_paths_and_methods_get_openai_errors_and_the_server_keeps_serving(keyed: Server) -> None:
    missing = httpx.get(f"{keyed.url}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong_method = httpx.get(f"{keyed.url}{CHAT}")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert httpx.get(f"{keyed.url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="guess", max_retries=0).models.list()
    assert httpx.get(f"{keyed.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{keyed.url}/ready").status_code == 200
    good = _post(keyed, CHAT, GOOD_CHAT)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_a_failed_step_ends_the_stream_with_an_error_event_and_ready_recovers(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Rank 1 fails its third step: the probe is its first, so the first request's second step fails.
    env = {faults.FAIL_ENV: "1:3"}
    with serving(
        tmp_path_factory, "--model", str(tiny_models["qwen3"]), "--tp", "2", env=env, module=faults.ENTRY
    ) as server:
        body = {"model": "qwen3", "prompt": "hello", "max_tokens": 10, "stream": True}
        with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=body, timeout=60) as response:
            events = list(sse_events(response))
        assert "[DONE]" not in events
        error = events[-1]["error"]
        assert error["code"] == "step_failed" and "rank 1" in error["message"], error
        # Unready from the failure until a probe of every rank passes, which the engine runs at once.
        failed = server.wait_log("not ready")
        assert "rank 1" in failed["reason"]
        wait_until(lambda: httpx.get(f"{server.url}/ready").status_code == 200, 30, "ready again")
        events = [e["event"] for e in server.logs()]
        assert events.index("ready", events.index("not ready")) > 0
        assert complete(server, max_tokens=4).choices[0].text


def test_a_model_whose_first_step_fails_never_serves(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    server = Server(
        "--model",
        str(tiny_models["qwen3"]),
        "--tp",
        "2",
        log_path=tmp_path / "log",
        env={faults.FAIL_ENV: "1:1"},
        module=faults.ENTRY,
    )
    rc = server.process.wait(timeout=120)
    server.stop()
    assert rc == 1
    assert "first step failed" in server.stderr() and "rank 1" in server.stderr()


def test_sigterm_lets_the_running_stream_finish_then_exits_0(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    server = Server("--model", str(tiny_models["qwen3"]), log_path=tmp_path / "log").start()
    try:
        rest = sigterm_mid_stream(server, 200)
        assert rest[-1] == "[DONE]"
        assert rest[-2]["choices"][0]["finish_reason"] == "length"
        rc = server.exit_code()
    finally:
        server.stop()
    assert rc == 0, server.stderr()
    assert server.find_log("draining") is not None and server.find_log("stopped") is not None


def test_smollm2_chat_over_http_equals_neuron_generate(
    smollm2: Path, smollm2_server: Server, smollm2_paris: subprocess.CompletedProcess[str]
) -> None:
    """The session's SmolLM2 server (the embedded default model) answers PARIS's question as the session's
    ``neuron generate`` run of it does, token for token."""
    question = PARIS[-1]
    reply = client(smollm2_server).chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": question}],
        temperature=0.0,
        max_tokens=int(PARIS[PARIS.index("--max-tokens") + 1]),
    )
    # A completion continues its prompt: its text is exactly its tokens' text, leading space included.
    continued = client(smollm2_server).completions.create(
        model="SmolLM2-135M-Instruct", prompt="The capital of France is", temperature=0.0, max_tokens=3, logprobs=0
    )
    assert continued.choices[0].text.startswith(" Paris")
    assert continued.choices[0].text == "".join(continued.choices[0].logprobs.tokens)
    text = reply.choices[0].message.content
    assert "Paris" in text and text == smollm2_paris.stdout.removesuffix("\n")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    messages = [{"role": "user", "content": question}]
    assert reply.usage.prompt_tokens == _chat_prompt_tokens(tokenizer, messages)


def test_http_layer_imports_no_mlx() -> None:
    code = "import sys, neuron.server.app; assert not [m for m in sys.modules if m.startswith('mlx')], 'mlx loaded'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_metrics_move_with_a_request(tp2: Server) -> None:
    before = tp2.metrics()
    reply = complete(tp2, max_tokens=12)
    refused = _post(tp2, COMPLETIONS, {"model": "qwen3", "prompt": "x", "max_tokens": -1}, key=None)
    assert refused.status_code == 400
    after = tp2.metrics()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    outcome = reply.choices[0].finish_reason
    assert grew("neuron_requests_total", outcome=outcome) == 1
    assert grew("neuron_requests_total", outcome="rejected") == 1
    assert grew("neuron_completion_tokens_total") == reply.usage.completion_tokens
    assert grew("neuron_prompt_tokens_total") == reply.usage.prompt_tokens
    assert grew("neuron_time_to_first_token_seconds_count") == 1
    # The prompt's step gives the first token, each later step one more and the draft tokens it kept.
    details = reply.usage.completion_tokens_details
    steps = reply.usage.completion_tokens - (details.accepted_prediction_tokens or 0 if details else 0)
    for part in ("total", "fanout", "rank0", "drain"):
        assert grew("neuron_step_seconds_count", part=part) >= steps
    assert after[("neuron_ready", ())] == 1.0
    assert after[("neuron_requests_running", ())] == 0.0
