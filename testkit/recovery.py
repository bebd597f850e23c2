"""A rank lost for real under streaming clients, and the time until the server is ready again: the recovery
test's trial (tests/e2e/faults/test_recovery.py), which ``bench/faults.py`` repeats."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx

from testkit.server import Server, sse_events, wait_until

COMPLETIONS = "/v1/completions"
GREEDY = {"model": "qwen3", "prompt": "hello", "max_tokens": 24, "temperature": 0.0}


@dataclass
class Stream:
    chunks: int = 0
    last: object = None
    ended_at: float = 0.0
    error: str = ""
    thread: threading.Thread | None = field(default=None, repr=False)


def _stream(url: str, stream: Stream) -> None:
    body = {**GREEDY, "max_tokens": 1900, "stream": True}
    try:
        with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=60) as response:
            for event in sse_events(response):
                stream.chunks += 1
                stream.last = event
    except httpx.HTTPError as e:  # a cut connection: what must never happen
        stream.error = f"{type(e).__name__}: {e}"
    stream.ended_at = time.monotonic()


def worker_pid(server: Server) -> int:
    return [e["pid"] for e in server.logs() if e.get("event") == "worker started"][-1]


def ready(server: Server) -> bool:
    try:
        return httpx.get(f"{server.url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False  # the fresh leader is still starting: the connection waits, or times out here


def kill_trial(server: Server, reference: str, rng: random.Random, sig: signal.Signals, end_within: float) -> float:
    """Lose rank 1 under 3 streams; returns seconds from the kill to ready again."""
    recovered_before = len([e for e in server.logs() if e.get("event") == "recovered"])
    victim = worker_pid(server)
    streams = [Stream() for _ in range(3)]
    for s in streams:
        s.thread = threading.Thread(target=_stream, args=(server.url, s), daemon=True)
        s.thread.start()
    at_least = rng.randint(1, 40)
    wait_until(lambda: all(s.chunks >= at_least for s in streams), 60, f"{at_least} chunks on every stream")
    killed_at = time.monotonic()
    os.kill(victim, sig)
    try:
        for s in streams:
            assert s.thread is not None
            s.thread.join(timeout=30)
            assert not s.thread.is_alive(), "a client was left hanging"
            assert s.error == "", s.error
            assert isinstance(s.last, dict) and "error" in s.last, f"the stream did not end with an error: {s.last}"
            assert "rank 1" in s.last["error"]["message"]
            assert s.ended_at - killed_at < end_within, f"a client waited {s.ended_at - killed_at:.1f} s"
    finally:
        if sig == signal.SIGSTOP:
            os.kill(victim, signal.SIGCONT)  # the recovery kills it anyway; this only avoids leaving it frozen
    wait_until(lambda: ready(server), 90, "ready again")
    time_to_ready = time.monotonic() - killed_at
    assert worker_pid(server) != victim
    wait_until(
        lambda: len([e for e in server.logs() if e.get("event") == "recovered"]) > recovered_before, 10, "recovered"
    )
    recovered = [e for e in server.logs() if e.get("event") == "recovered"][-1]
    assert "rank 1" in recovered["cause"] and recovered["ms"] > 0
    again = httpx.post(f"{server.url}{COMPLETIONS}", json=GREEDY, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference
    return time_to_ready
