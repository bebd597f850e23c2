"""Streams that must outlive a lost rank: four concurrent requests (greedy and seeded) streamed from a real server
while a rank is killed, stopped or cut off; the resume tests (tests/e2e/faults/test_resume.py, tests/e2e/hosts/) and
``bench/resume.py`` share it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from testkit.server import Server, wait_until

COMPLETIONS = "/v1/completions"
# Two greedy, two seeded; ignore_eos keeps each running long enough to be cut mid-stream.
BODIES: list[dict[str, Any]] = [
    {"prompt": "hello", "temperature": 0.0},
    {"prompt": "The capital of France is", "temperature": 0.0, "logprobs": 2},
    {"prompt": "Once upon a time", "temperature": 0.9, "top_p": 0.95, "seed": 7},
    {"prompt": "def fib(n):", "temperature": 0.7, "seed": 11, "presence_penalty": 0.5},
]
MAX_TOKENS = 300


def served(url: str) -> str:
    """The id of the model ``url`` serves."""
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def body(url: str, base: dict[str, Any], stream: bool) -> dict[str, Any]:
    return {"model": served(url), "max_tokens": MAX_TOKENS, "ignore_eos": True, **base, "stream": stream}


def shorter(max_tokens: int) -> list[dict[str, Any]]:
    """``BODIES`` asking for ``max_tokens`` each (a slower server: across hosts)."""
    return [{**base, "max_tokens": max_tokens} for base in BODIES]


def reference(url: str, base: dict[str, Any]) -> str:
    """The text an undisturbed server gives."""
    reply = httpx.post(f"{url}{COMPLETIONS}", json=body(url, base, stream=False), timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def references(url: str, bases: list[dict[str, Any]]) -> list[str]:
    """``reference`` for each of ``bases``, asked at once: batched, each gets the text it gets alone (what
    ``disturb`` holds concurrent streams to anyway), in the time of one."""
    with ThreadPoolExecutor(len(bases)) as pool:
        return list(pool.map(lambda base: reference(url, base), bases))


@dataclass
class Stream:
    """One streamed request as its client saw it."""

    base: dict[str, Any]
    text: str = ""
    chunks: int = 0
    times: list[float] = field(default_factory=list)  # monotonic time of each chunk
    keep_alives: int = 0
    error: Any = None  # an error event, or the exception that cut the connection
    finish: str | None = None
    usage: dict[str, Any] | None = None
    id: str = ""  # the request's id, as the server logs it
    thread: threading.Thread | None = field(default=None, repr=False)

    def first_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` to this stream's first chunk after it."""
        return next((t - moment for t in self.times if t > moment), None)


def _read(url: str, stream: Stream) -> None:
    import json

    request = {**body(url, stream.base, stream=True), "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{url}{COMPLETIONS}", json=request, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith(":"):
                    stream.keep_alives += 1
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    stream.error = event["error"]
                    continue
                stream.id = event.get("id", stream.id)
                if event.get("usage"):
                    stream.usage = event["usage"]
                for choice in event.get("choices", []):
                    stream.text += choice.get("text", "")
                    stream.finish = choice.get("finish_reason") or stream.finish
                    stream.chunks += 1
                    stream.times.append(time.monotonic())
    except httpx.HTTPError as e:
        stream.error = f"{type(e).__name__}: {e}"


def start_streams(url: str, bases: list[dict[str, Any]]) -> list[Stream]:
    streams = [Stream(base) for base in bases]
    for s in streams:
        s.thread = threading.Thread(target=_read, args=(url, s), daemon=True)
        s.thread.start()
    return streams


def join(streams: list[Stream], timeout: float = 300) -> None:
    for s in streams:
        assert s.thread is not None
        s.thread.join(timeout)
        assert not s.thread.is_alive(), f"a client was left hanging: {s.base}"


def worker_pid(server: Server, rank: int = 1) -> int:
    """The newest worker of ``rank``."""
    return [e["pid"] for e in server.logs() if e.get("event") == "worker started" and e.get("rank") == rank][-1]


def disturb(
    server: Server,
    references: list[str],
    fault: Callable[[], None],
    at_least: int = 5,
    bases: list[dict[str, Any]] = BODIES,
) -> tuple[list[Stream], float]:
    """Stream every request of ``bases``, call ``fault`` once each has ``at_least`` chunks, and check each stream
    ends as an undisturbed one did: the same text, no error event, usage counted once; and that each stream the
    fault cut mid-way resumed. Returns the streams and the moment of the fault.

    The fault lands mid-stream by construction (each request asks for many more tokens than ``at_least``), and
    what the server itself logged decides: a stream whose request was done there before the fault (the server can
    run ahead of its client) is not expected to resume; every other one is, and at least one must have been cut."""
    resumed_before = len([e for e in server.logs() if e.get("event") == "resumed"])
    streams = start_streams(server.url, bases)
    wait_until(lambda: all(s.chunks >= at_least for s in streams), 60, f"{at_least} chunks on every stream")
    at, at_wall = time.monotonic(), time.time()
    fault()
    join(streams)
    for s, expected in zip(streams, references, strict=True):
        assert s.error is None, f"{s.base}: {s.error}"
        assert s.text == expected, f"{s.base}: resumed text differs:\n{s.text!r}\n{expected!r}"
        asked = s.base.get("max_tokens", MAX_TOKENS)
        assert s.finish == "length" and s.usage is not None and s.usage["completion_tokens"] == asked, s.usage
    logs = server.logs()
    resumed = [e["request_id"] for e in logs if e.get("event") == "resumed"][resumed_before:]
    done = {e["request_id"]: _wall(e["timestamp"]) for e in logs if e.get("event") == "request done"}
    cut = [s for s in streams if done.get(s.id, at_wall) >= at_wall]
    assert cut, "every stream was done before the fault landed: ask for more tokens"
    for s in cut:
        assert s.id in resumed, f"{s.base} ({s.id}) was cut mid-way by the fault and not resumed"
    return streams, at


def _wall(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def kill(pid: int, sig: signal.Signals) -> Callable[[], None]:
    return lambda: os.kill(pid, sig)
