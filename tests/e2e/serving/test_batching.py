"""Continuous batching: concurrent requests decode together, and each gets exactly what it would get alone.

Greedy runs are compared by ``closeness.assert_same``: exactly on the CPU; on a GPU a difference only at a near
tie (batch shapes change the kernels' reduction order). Seeded sampling is compared exactly everywhere.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from testkit import Server, faults, serving_side_by_side, wait_until
from testkit.closeness import TOP, Scored, assert_all_same, assert_same

# Different lengths, some longer than the prefill chunk the servers here use (16),
# so prompts are fed over several steps while others decode.
PROMPTS = [
    "hello",
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "a",
    "Once upon a time",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "What is the capital of France?",
    "zzzz",
    "Tensor parallel inference splits every layer over several ranks.",
]
MAX_TOKENS = [24, 9, 30, 16, 12, 27, 20, 5]  # they finish, and leave the batch, at different steps


async def _complete(server: Server, model: str, prompt: str, max_tokens: int, **kwargs: object) -> str:
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
        reply = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            **kwargs,  # type: ignore[arg-type]
        )
        return reply.choices[0].text


async def _scored(server: Server, model: str, prompt: str, max_tokens: int) -> Scored:
    """A greedy completion with its logprobs, for ``closeness``."""
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
        reply = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=TOP
        )
        return Scored.of(reply.choices[0].model_dump())


async def _alone_then_together(
    server: Server, model: str, complete: Callable[..., Awaitable[Any]] = _complete, **kwargs: object
) -> tuple[list[Any], list[Any]]:
    alone = [await complete(server, model, p, n, **kwargs) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    together: list[Any] = [None] * len(PROMPTS)

    async def one(i: int) -> None:
        together[i] = await complete(server, model, PROMPTS[i], MAX_TOKENS[i], **kwargs)

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return alone, together


def _most_running(server: Server) -> int:
    """The most requests in the batch at once, from the log's start and end events."""
    running = most = 0
    for entry in server.logs():
        if entry.get("event") == "request started":
            running += 1
            most = max(most, running)
        elif entry.get("event") in ("request done", "request cancelled"):
            running -= 1
    return most


@pytest.mark.anyio
async def test_eight_concurrent_greedy_requests_equal_each_alone(split_qwen3: Server) -> None:
    alone, together = await _alone_then_together(split_qwen3, "qwen3", _scored)
    assert_all_same(alone, together, "prompt")
    texts = [run.text for run in alone]
    assert all(texts) and len(set(texts)) == len(texts)
    assert _most_running(split_qwen3) >= 6  # they really shared steps


@pytest.mark.anyio
async def test_seeded_sampling_concurrent_equals_alone(split_qwen3: Server) -> None:
    alone, together = await _alone_then_together(split_qwen3, "qwen3", temperature=0.9, seed=1234, top_p=0.95)
    assert together == alone


def _stream(server: Server, prompt: str, max_tokens: int) -> Iterator[Scored]:
    body = {"model": "qwen3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "logprobs": TOP}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                yield Scored.of(httpx.Response(200, content=line[6:]).json()["choices"][0], streamed=True)


@pytest.mark.anyio
async def test_one_of_four_streams_disconnecting_leaves_the_others_unchanged(split_qwen3: Server) -> None:
    prompts, lengths = PROMPTS[:4], [60, 60, 60, 60]
    alone = [await _scored(split_qwen3, "qwen3", p, n) for p, n in zip(prompts, lengths, strict=True)]
    pieces: list[list[Scored]] = [[], [], [], []]

    def read(i: int) -> None:
        for count, piece in enumerate(_stream(split_qwen3, prompts[i], lengths[i])):
            pieces[i].append(piece)
            if i == 0 and count == 5:
                return  # leaves mid-stream: the connection closes

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(anyio.to_thread.run_sync, read, i)
    streams = [Scored.joined(p) for p in pieces]
    assert_all_same(alone[1:], streams[1:], "stream")  # their neighbour's leaving changed nothing
    left = len(streams[0].tokens)
    assert 0 < left < len(alone[0].tokens)
    assert_same(alone[0].head(left), streams[0].head(left), "the stream that left")
    cancelled = split_qwen3.wait_log("request cancelled", timeout=30)
    assert cancelled["steps_after_cancel"] <= 1


@pytest.mark.anyio
async def test_a_desync_names_the_rank_fails_the_batch_and_the_next_requests_succeed(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """At TP=2 and in two pipeline stages: one server each, started side by side (a start is mostly one process
    importing) and asked one at a time; each failure names its split."""
    # Rank 1 records a wrong token at its 6th step (the probe is its 1st): its digest no longer matches rank 0's.
    env = {faults.DESYNC_ENV: "1:6"}
    splits = {"tp2": ("--tp", "2"), "pp2": ("--pp", "2", "--micro-batches", "2")}
    commands = (("--prefill-chunk", "16", "--model", str(tiny_models["qwen3"]), *split) for split in splits.values())
    with serving_side_by_side(tmp_path_factory, *commands, env=env, module=faults.ENTRY) as servers:
        for name, server in zip(splits, servers, strict=True):
            with pytest.raises(openai.InternalServerError) as caught:
                await _complete(server, "qwen3", "hello", 20, temperature=0.0)
            message = str(caught.value)
            assert "desync" in message and "rank 1" in message, (name, message)
            assert server.find_log("desync") is not None, name
            alone, together = await _alone_then_together(server, "qwen3", _scored)
            assert_all_same(alone, together, f"{name}: prompt")


@pytest.mark.anyio
async def test_smollm2_eight_concurrent_chats_equal_each_alone(smollm2_server: Server) -> None:
    """On the session's SmolLM2 server (conftest), which asking it does not disturb: a server of its own would cost a
    start of the real model for eight short chats."""
    questions = [
        "What is the capital of France?",
        "Name three colours.",
        "What is 2 + 2?",
        "Say hello in Spanish.",
        "What is the largest planet?",
        "Who wrote Hamlet?",
        "What do bees make?",
        "How many legs does a spider have?",
    ]

    async def chat(question: str) -> str:
        async with openai.AsyncOpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0) as client:
            reply = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": question}],
                temperature=0.0,
                max_tokens=24,
            )
            return reply.choices[0].message.content or ""

    alone = [await chat(q) for q in questions]
    together = [""] * len(questions)

    async def one(i: int) -> None:
        together[i] = await chat(questions[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(questions)):
            tg.start_soon(one, i)
    assert together == alone
    assert "Paris" in alone[0]


@pytest.mark.anyio
async def test_a_request_cancelled_before_its_prompt_is_fed_does_not_disturb_the_batch(split_qwen3: Server) -> None:
    # A long prompt takes several steps at 16 tokens per step; a longer one admitted meanwhile waits for its first
    # chunk (the prompt with the fewest tokens left is fed first). If its client leaves then, no rank ever held it:
    # it must simply vanish. Both prompts are new to the server (a cached one would be restored in one step); what
    # the first gives alone is asked after. The long prompt takes dozens of steps, so that the longer one is admitted
    # during them even on a loaded machine.
    long_prompt, longer_prompt = "the " * 150, "a " * 400

    def count(event: str) -> int:
        return sum(e.get("event") == event for e in split_qwen3.logs())

    started, cancelled = count("request started"), count("request cancelled")

    def leave_once_admitted() -> None:
        wait_until(lambda: count("request started") == started + 1, 30, "the long request's admission")
        body = {"model": "qwen3", "prompt": longer_prompt, "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{split_qwen3.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            wait_until(lambda: count("request started") == started + 2, 30, "the short request's admission")

    runs: list[Scored] = []

    async def long_one() -> None:
        runs.append(await _scored(split_qwen3, "qwen3", long_prompt, 8))

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_one)
        await anyio.to_thread.run_sync(leave_once_admitted)
    # The server learns of the disconnect on its own time: the long request may already have ended by then.
    await anyio.to_thread.run_sync(
        wait_until, lambda: count("request cancelled") == cancelled + 1, 30, "the longer request's cancellation"
    )
    left = [e for e in split_qwen3.logs() if e.get("event") == "request cancelled"][-1]
    assert left["completion_tokens"] == 0, left  # it left before its prompt was fed
    assert len(runs) == 1
    assert_same(await _scored(split_qwen3, "qwen3", long_prompt, 8), runs[0], "beside a cancelled request")
    assert split_qwen3.find_log("desync") is None


def test_a_pipelines_split_is_in_its_metrics(split_qwen3: Server) -> None:
    metrics = split_qwen3.metrics()
    stages = {labels: value for (name, labels), value in metrics.items() if name == "neuron_stage_layers"}
    if "--pp" not in split_qwen3.args:
        assert not stages
        return
    assert stages == {(("host", "localhost"), ("rank", "0")): 2.0, (("host", "localhost"), ("rank", "1")): 2.0}
