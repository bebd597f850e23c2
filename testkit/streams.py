"""Decoding streams timed token by token while a long prompt prefills beside them, against a real ``neuron serve``.
Shared by tests/e2e/serving/test_long_prompt.py and bench/long_prompt.py.

Each stream is a streamed ``/v1/completions`` request that generates past end-of-sequence (``ignore_eos``), with
``logprobs`` so that every token is counted where its text is held back (a byte of a longer character). Once every
stream has its first tokens, the long prompt is sent (streamed, one token); its send and its first token mark the
window in which the streams are measured. Without a long prompt, the window is as many of the streams' tokens.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx

from testkit.server import sse_events, wait_until


@dataclass
class Stream:
    arrivals: list[float] = field(default_factory=list)  # when each token arrived (time.monotonic)
    error: BaseException | None = None

    def between(self, start: float, end: float) -> int:
        """Tokens that arrived within [start, end]."""
        return sum(start <= t <= end for t in self.arrivals)

    def gaps(self, start: float, end: float) -> list[float]:
        """Seconds between consecutive tokens, for each gap that overlaps [start, end]: a stream's token of the step
        that ends a window can arrive just after the window's own token, and its wait counts."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False) if a <= end and b >= start]


@dataclass
class Window:
    streams: list[Stream]
    start: float  # the long prompt sent (or the window's start, without one)
    end: float  # its first token (or the window's end)

    def gaps(self) -> list[float]:
        return [gap for s in self.streams for gap in s.gaps(self.start, self.end)]

    def percentile(self, q: int) -> float:
        """The ``q``th percentile of the streams' inter-token gaps in the window, in seconds."""
        gaps = sorted(self.gaps())
        return statistics.quantiles(gaps, n=100, method="inclusive")[q - 1] if len(gaps) > 1 else gaps[0]


def _decode(url: str, model: str, prompt: list[int], max_tokens: int, stream: Stream, stop: threading.Event) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "logprobs": 0,
        "stream": True,
    }
    try:
        with httpx.Client(base_url=url, timeout=600) as http, http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for event in sse_events(r):
                if event == "[DONE]":
                    return
                assert isinstance(event, dict)
                now = time.monotonic()
                for choice in event["choices"]:
                    stream.arrivals.extend([now] * len((choice.get("logprobs") or {}).get("tokens") or []))
                if stop.is_set():  # after the token that ends the window's last gap is counted
                    return  # leaving closes the connection: the server cancels the stream
    except BaseException as error:  # noqa: BLE001 - handed to the caller, who fails with it
        stream.error = error


def measure(
    url: str,
    model: str,
    *,
    streams: int = 3,
    long_prompt: list[int] | None = None,
    window_tokens: int = 40,
    max_tokens: int = 4000,
    timeout: float = 300,
) -> Window:
    """Start ``streams`` decoding streams; once each has a token, send ``long_prompt`` and time it to its first
    token (without one: wait for ``window_tokens`` more tokens on every stream); then close the streams."""
    stop = threading.Event()
    timed = [Stream() for _ in range(streams)]
    threads = [
        threading.Thread(target=_decode, args=(url, model, [10 + i, 20 + i, 30 + i], max_tokens, s, stop))
        for i, s in enumerate(timed)
    ]
    for thread in threads:
        thread.start()
    try:

        def each_has(tokens: int) -> bool:
            for s in timed:
                if s.error is not None:
                    raise AssertionError(f"a decoding stream failed: {s.error!r}")
            return all(len(s.arrivals) >= tokens for s in timed)

        wait_until(lambda: each_has(2), timeout, "every decoding stream's first tokens")
        start = time.monotonic()
        if long_prompt is None:
            counts = [len(s.arrivals) for s in timed]
            wait_until(lambda: each_has(max(counts) + window_tokens), timeout, f"{window_tokens} more tokens each")
            return Window(timed, start, time.monotonic())
        body = {"model": model, "prompt": long_prompt, "max_tokens": 1, "temperature": 0.0, "stream": True}
        with (
            httpx.Client(base_url=url, timeout=timeout) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            r.raise_for_status()
            for event in sse_events(r):
                if isinstance(event, dict) and "error" in event:
                    raise AssertionError(f"the long prompt failed: {event['error']}")
                if isinstance(event, dict) and event["choices"]:
                    break
            end = time.monotonic()
        each_has(0)  # a stream that failed meanwhile fails the measure
        return Window(timed, start, end)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout)
