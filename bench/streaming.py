"""One streamed, greedy ``/v1/completions`` request, timed: shared by the benchmarks."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

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


TEXT = re.compile(rb'"text":"[^"]')  # a completions chunk that carries text


def stream_completion_light(url: str, model: str, prompt: str, max_tokens: int) -> Streamed:
    """``stream_completion`` over a bare socket: one request, the response read as it comes, each event found by its
    blank line and only the last (``usage``) parsed as JSON. A client that costs the machine as little as a
    streamed client can, to tell the server's share of a step from httpx's."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payload = json.dumps(body).encode()
    host, port = urlsplit(url).hostname or "127.0.0.1", urlsplit(url).port or 80
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    ).encode()
    started, text_at, usage, buffer = time.perf_counter(), [], None, b""
    with socket.create_connection((host, port), timeout=900) as conn:
        conn.sendall(head + payload)
        while data := conn.recv(65536):
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if TEXT.search(event):
                    text_at.append(time.perf_counter())
                elif b'"usage":{' in event:
                    usage = json.loads(event[event.index(b"data: ") + 6 :])["usage"]["completion_tokens"]
            if buffer.endswith(b"0\r\n\r\n") and usage is not None:  # the last chunk of the chunked body
                break
    return Streamed(started, text_at, usage if usage is not None else len(text_at))
