"""Decode running ahead of its plan changes no output: the same mixed load, served with ``--run-ahead on`` and off.

Two ranks (the tokens reach the worker inside an all-reduce when running ahead) and a load that makes the batch
change under the steps run ahead: requests joining and leaving at different steps, n = 2, a prompt restored from
the prefix cache, a JSON schema, a stop string, logprobs, penalties and seeded sampling, a prediction (drafts,
which do not run ahead), and a request cancelled mid-stream. Greedy and seeded replies must be identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from testkit import serving_side_by_side

pytestmark = pytest.mark.gpu  # where the device computes apart from the host: bench/gpu_table.py runs them there

PROMPT = "The quick brown fox jumps over the lazy dog, again and again and again."
REQUESTS: list[dict[str, Any]] = [
    {"prompt": "hello", "max_tokens": 24},
    {"prompt": PROMPT, "max_tokens": 9},
    {"prompt": PROMPT + " Then", "max_tokens": 12},  # starts as the one before: restored from the prefix cache
    {"prompt": "Once upon a time", "max_tokens": 16, "n": 2, "temperature": 0.9, "seed": 5},
    {"prompt": "1 2 3 4 5", "max_tokens": 20, "logprobs": 3, "presence_penalty": 0.8, "repetition_penalty": 1.3},
    {"prompt": "a b c d e f", "max_tokens": 30, "stop": ["e"], "temperature": 0.7, "seed": 11, "top_p": 0.9},
    {"prompt": "zzzz", "max_tokens": 18, "prediction": {"type": "content", "content": "zzzz zzzz zzzz zzzz"}},
]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


async def _load(url: str) -> list[Any]:
    out: list[Any] = [None] * (len(REQUESTS) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def complete(i: int, body: dict[str, Any]) -> None:
            await anyio.sleep(0.05 * i)  # arrivals spread over the steps, so the batch changes while it decodes
            reply = await client.post("/v1/completions", json={"model": "qwen3", "temperature": 0.0, **body})
            assert reply.status_code == 200, reply.text
            out[i] = [_choice(c) for c in reply.json()["choices"]]

        async def constrained() -> None:
            chat = {"messages": [{"role": "user", "content": "a number"}], "max_tokens": 24}
            schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
            body = {"model": "qwen3", "temperature": 0.0, "response_format": schema, **chat}
            reply = await client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            out[-1] = reply.json()["choices"][0]["message"]["content"]

        async def cancelled() -> None:  # leaves mid-stream: its row is dropped under a step run ahead
            body = {"model": "qwen3", "prompt": "cancel me", "max_tokens": 200, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as stream:
                async for _ in stream.aiter_lines():
                    break

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancelled)
            for i, body in enumerate(REQUESTS):
                tg.start_soon(complete, i, body)
            tg.start_soon(constrained)
    return out


def test_running_ahead_changes_no_reply(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> None:
    args = ("--model", str(tiny_models["qwen3"]), "--tp", "2", "--prefill-chunk", "16")
    modes = ("on", "off")
    replies = {}
    commands = ((*args, "--run-ahead", mode) for mode in modes)
    # Started side by side, asked one at a time: each load's arrivals are timed against its own server's steps.
    with serving_side_by_side(tmp_path_factory, *commands) as servers:
        for run_ahead, server in zip(modes, servers, strict=True):
            replies[run_ahead] = anyio.run(_load, server.url)
            ahead = _counter(httpx.get(f"{server.url}/metrics").text, "neuron_steps_run_ahead_total")
            assert (ahead > 0) == (run_ahead == "on"), ahead
    assert _same(replies["on"], replies["off"]), (replies["on"], replies["off"])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _choice(choice: dict[str, Any]) -> tuple[Any, ...]:
    """A choice's text, finish, tokens and logprobs (``_same`` compares the logprobs within a tolerance: rows
    batched with others of another shape sum in another order, and a float's last bits may differ where no token
    does)."""
    logprobs = choice.get("logprobs") or {}
    return choice["text"], choice["finish_reason"], logprobs.get("tokens"), logprobs.get("token_logprobs") or []


def _counter(exposition: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in exposition.splitlines() if line.startswith(f"{name} "))
