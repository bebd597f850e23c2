"""An urgent request sent while the batch is full of low-priority streams: its time to first token against the
same request's on an idle server, counted in steps, at TP=2 and PP=2 (issue 64, "priority, end to end").

Run: .venv/bin/python bench/priority.py [--splits tp2,pp2] [--batch 4] [--rounds 5] [shape flags]

One ``neuron serve --scheduling-policy priority --max-batch BATCH --speculate off --log-level trace`` per split, on
a generated Qwen3 (``bench/generated.py``'s shape flags; speculation off so that a step is one token). Each
prompt's text alone is taken first (greedy, ``ignore_eos``). Then, per round: the urgent request (priority -1)
alone on the idle server; and the batch filled with BATCH low-priority streams (priority 5), the urgent one sent
once every stream has its first token. For each, the steps the leader logged between the request's sending and
its first token are counted (a step's entry is written as it ends), and its time to first token is taken. Every
stream's text, the preempted ones' too, is checked against its text alone. The figure: the loaded time to first
token less the idle one, in the loaded server's median step times, against the issue's two steps.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.generated import add_shape_flags, generated_model  # noqa: E402
from testkit import Server, greedy_body, sse_events  # noqa: E402

URGENT = "Is the lamp lit?"
LOW = [
    "The keeper climbs the stairs at dusk",
    "Waves fold over the old stone pier",
    "A gull circles the harbour wall",
    "Fog rolls in across the bay at noon",
    "Nets dry on the rocks by the sheds",
    "The ferry horn sounds twice at dawn",
    "Lanterns swing above the fish market",
    "Salt crusts the windows of the inn",
]


class Stream:
    """One streamed completion on a thread of its own: when it was sent and when its first token came (wall clock,
    as the log's timestamps), and its text."""

    def __init__(self, url: str, prompt: str, max_tokens: int, priority: int) -> None:
        self.body = greedy_body(prompt, max_tokens, priority, stream=True)
        self.pieces: list[str] = []
        self.first = threading.Event()
        self.sent = self.first_at = 0.0
        self.error: str | None = None
        self.id = ""
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url: str) -> None:
        self.sent = time.time()
        with httpx.stream("POST", f"{url}/v1/completions", json=self.body, timeout=600) as reply:
            for event in sse_events(reply):
                if not isinstance(event, dict):
                    continue
                self.id = event.get("id", self.id)
                if "error" in event:
                    self.error = str(event["error"])
                for choice in event.get("choices", []):
                    if choice["text"]:
                        if not self.first.is_set():
                            self.first_at = time.time()
                            self.first.set()
                        self.pieces.append(choice["text"])
        self.first.set()

    def text(self) -> str:
        self.thread.join(600)
        if self.error is not None:
            raise RuntimeError(f"a stream failed: {self.error}")
        return "".join(self.pieces)


def step_ends(server: Server) -> list[tuple[float, float]]:
    """Each step the leader logged: when it ended (wall clock) and its milliseconds."""
    return [(stamp(e), e["ms"]) for e in server.logs() if e.get("event") == "step"]


def stamp(entry: dict) -> float:
    return datetime.fromisoformat(entry["timestamp"]).timestamp()


def served(server: Server, stream: Stream) -> tuple[float, int]:
    """The server's own time to first token for ``stream`` (from its request's arrival in the engine's queue to
    its first token, as the leader logged them: no client in it), and how many steps ended in that time."""
    entries = [e for e in server.logs() if e.get("request_id") == stream.id]
    started = next(e for e in entries if e["event"] == "request started")
    first = next(e for e in entries if e["event"] == "prefill done")
    submitted, first_at = stamp(started) - started["waited_ms"] / 1000, stamp(first)
    return first_at - submitted, sum(1 for end, _ in step_ends(server) if submitted < end <= first_at)


def lows_apart(url: str, prompts: list[str], tokens: int, started: Any, texts: Any) -> None:
    """The low-priority streams, in a process of their own so that their reading does not delay the urgent
    request's client (one interpreter's threads take turns)."""
    streams = [Stream(url, p, tokens, 5) for p in prompts]
    for stream in streams:
        stream.first.wait(600)
    started.set()
    texts.put([stream.text() for stream in streams])


def measure(split: str, model: Path, args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    flag, n = split[:2], split[2:]
    server = Server(
        "--model",
        str(model),
        f"--{flag}",
        n,
        "--scheduling-policy",
        "priority",
        "--max-batch",
        str(args.batch),
        "--speculate",
        "off",
        "--log-level",
        "trace",
        log_path=scratch / f"{split}.log",
    )
    lows = LOW[: args.batch]
    client: dict[str, list[float]] = {"idle": [], "loaded": []}
    server_s: dict[str, list[float]] = {"idle": [], "loaded": []}
    steps: dict[str, list[int]] = {"idle": [], "loaded": []}
    step_ms: list[float] = []
    spawn = multiprocessing.get_context("spawn")
    try:
        server.start()
        alone = [Stream(server.url, p, args.low_tokens, 0).text() for p in lows]
        urgent_alone = Stream(server.url, URGENT, args.urgent_tokens, 0).text()

        def urgent(kind: str) -> None:
            stream = Stream(server.url, URGENT, args.urgent_tokens, -1)
            if stream.text() != urgent_alone:
                raise RuntimeError(f"the urgent request's text differs ({kind})")
            client[kind].append(stream.first_at - stream.sent)
            seconds, count = served(server, stream)
            server_s[kind].append(seconds)
            steps[kind].append(count)

        for _ in range(args.rounds):
            urgent("idle")
            started, texts = spawn.Event(), spawn.Queue()
            apart = spawn.Process(target=lows_apart, args=(server.url, lows, args.low_tokens, started, texts))
            apart.start()
            if not started.wait(600):
                raise RuntimeError("the low-priority streams did not start")
            began = time.time()
            urgent("loaded")
            if texts.get(timeout=600) != alone:
                raise RuntimeError("a low-priority stream's text was disturbed")
            apart.join()
            # The full batch's steps around the urgent request: the loaded server's step time.
            step_ms.extend(ms for end, ms in step_ends(server) if began - 0.5 < end <= began + 0.5)
        preempted = server.metrics()[("neuron_num_preemptions_total", (("reason", "priority"),))]
    finally:
        server.stop()
    step = statistics.median(step_ms)
    print(f"{split}: batch {args.batch} x {args.low_tokens} tokens at priority 5, {args.rounds} rounds")
    print(f"  the loaded server's median step: {step:.1f} ms; preemptions for priority: {preempted:.0f};")
    print("  every text, the preempted streams' too, equal to its text alone")
    gaps = {}
    for what, times in (("server", server_s), ("client", client)):
        idle, loaded = statistics.median(times["idle"]) * 1e3, statistics.median(times["loaded"]) * 1e3
        gaps[what] = (loaded - idle) / step
        print(f"  time to first token ({what}): idle {idle:.1f} ms, loaded {loaded:.1f} ms,", end=" ")
        print(f"gap {gaps[what]:.2f} steps (bound: 2)")
    print(f"  steps ended from arrival to first token: idle {steps['idle']}, loaded {steps['loaded']}")
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--splits", default="tp2,pp2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--low-tokens", type=int, default=96)
    parser.add_argument("--urgent-tokens", type=int, default=8)
    add_shape_flags(parser)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp())
    print(f"the servers' logs: {scratch}")
    model = generated_model(args, scratch / "qwen3")
    for split in args.splits.split(","):
        measure(split, model, args, scratch)


if __name__ == "__main__":
    main()
