"""Speculative decoding without a draft model: prompt lookup and ``prediction`` drafts, verified in the batch.

Speculation must be lossless: every test compares a request with drafts against the same request with
``num_draft_tokens: 0`` on the same server (no drafts), alone and concurrent, at TP=1, TP=2 and in a pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from conftest import Server, serving

from neuron.engine.speculate import Proposer, lookup

# Repetitive prompts: prompt lookup finds drafts in them, and the tiny models repeat themselves too.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "one two three four one two three four one two three four one two",
    "hello",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
]
MAX_TOKENS = [40, 33, 25, 47]


@pytest.fixture(
    scope="module",
    params=[("--tp", "1"), ("--tp", "2"), ("--pp", "2", "--micro-batches", "2")],
    ids=["tp1", "tp2", "pp2"],
)
def tiny(
    request: pytest.FixtureRequest, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    args = ("--model", str(tiny_models["qwen3"]), "--prefill-chunk", "16", *request.param)
    with serving(tmp_path_factory, *args) as server:
        yield server


def _complete(server: Server, prompt: str, max_tokens: int, **extra: object) -> dict:
    body = {"model": "qwen3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


async def _together(server: Server, **extra: object) -> list[dict]:
    out: list[dict] = [{}] * len(PROMPTS)

    async def one(i: int) -> None:
        out[i] = await anyio.to_thread.run_sync(lambda: _complete(server, PROMPTS[i], MAX_TOKENS[i], **extra))

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return out


def _texts(replies: list[dict]) -> list[str]:
    return [r["choices"][0]["text"] for r in replies]


@pytest.mark.anyio
async def test_greedy_is_identical_with_and_without_drafts_alone_and_concurrent(tiny: Server) -> None:
    plain = [_complete(tiny, p, n, num_draft_tokens=0) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    alone = [_complete(tiny, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    together = await _together(tiny)
    assert _texts(alone) == _texts(plain)
    assert _texts(together) == _texts(plain)
    assert [r["usage"]["completion_tokens"] for r in alone] == [r["usage"]["completion_tokens"] for r in plain]
    accepted = sum(r["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] for r in alone)
    assert accepted > 0  # drafts were really verified and kept
    assert all(r["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0 for r in plain)
