"""One streamed, greedy ``/v1/completions`` request, timed: shared by the benchmarks."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class Streamed:
    started: float  # perf_counter when the request was sent
    text_at: list[float]  # perf_counter of every event that carried text
    tokens: int  # completion tokens, from ``usage``; else one per text event


def events(url: str, route: str, body: dict) -> Iterator[dict]:
    """A streamed, greedy request's events, each JSON object as it arrives (usage included)."""
    body = {**body, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=900) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])


def stream_completion(url: str, model: str, prompt: str, max_tokens: int) -> Streamed:
    started, text_at, usage = time.perf_counter(), [], None
    for event in events(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens}):
        if event.get("usage"):
            usage = event["usage"]["completion_tokens"]
        if event.get("choices") and event["choices"][0].get("text"):
            text_at.append(time.perf_counter())
    return Streamed(started, text_at, usage if usage is not None else len(text_at))
