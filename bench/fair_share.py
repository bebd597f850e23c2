"""A light API key's time to first token, alone and beside a heavy key that keeps 16 requests in flight (issue 64's
fair share), with the heavy key's clients in a process of their own.

Run: .venv/bin/python bench/fair_share.py [--rounds 5] [--samples 15] [--in-process]

One ``neuron serve`` of the tiny generated qwen3 (TP=1, ``--max-batch 4``, speculation off, two keys in a keys
file), as tests/e2e/serving/test_keys.py serves it. Each round times the light key's streamed 2-token completion
``--samples`` times alone, then as many times while the heavy key's 16 clients each send their next 48-token
completion as the last ends: the light client's time to first token, sent to first text. ``--in-process`` runs the
heavy clients as threads of this process, as the e2e test does: the light client's thread then shares its
interpreter with sixteen others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit import Server, sse_events  # noqa: E402
from testkit.models import make_tiny_model  # noqa: E402

PEOPLE, AGENTS = "people-secret", "agents-secret"
KEYS = {"keys": [{"name": "people", "key": PEOPLE, "admin": True}, {"name": "agents", "key": AGENTS}]}
HEAVY_IN_FLIGHT, HEAVY_TOKENS = 16, 48

# The heavy key's clients, run with ``python -c`` in a process of their own: each sends its next request as its
# last one ends, until its stdin closes.
HEAVY = """
import sys, threading, httpx
url, key, tokens, clients = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
stop = threading.Event()
def client():
    body = {"model": "qwen3", "prompt": "The keeper climbs the stairs at dusk", "max_tokens": tokens,
            "temperature": 0.0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=120) as c:
        while not stop.is_set():
            c.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
for t in threads:
    t.start()
sys.stdin.read()
stop.set()
"""


def light(client: httpx.Client) -> float:
    """The light key's streamed 2-token completion on a kept-alive connection: seconds from sending it to its first
    text."""
    body = {"model": "qwen3", "prompt": "Is the lamp lit?", "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    started = time.perf_counter()
    with client.stream(
        "POST", "/v1/completions", json=body | {"stream": True}, headers={"authorization": f"Bearer {PEOPLE}"}
    ) as reply:
        for event in sse_events(reply):
            if isinstance(event, dict) and event["choices"][0]["text"]:
                return time.perf_counter() - started
    raise RuntimeError("the light request gave no text")


def in_flight(server: Server) -> float:
    metrics = server.metrics()
    return metrics[("neuron_requests_running", ())] + metrics[("neuron_requests_waiting", ())]


class HeavyThreads:
    def __init__(self, url: str) -> None:
        self.stop = threading.Event()
        self.url = url
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(HEAVY_IN_FLIGHT)]

    def client(self) -> None:
        body = {"model": "qwen3", "prompt": "The keeper climbs the stairs at dusk", "max_tokens": HEAVY_TOKENS}
        body |= {"temperature": 0.0, "ignore_eos": True}
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while not self.stop.is_set():
                c.post("/v1/completions", json=body, headers={"authorization": f"Bearer {AGENTS}"})

    def __enter__(self) -> HeavyThreads:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


class HeavyProcess:
    def __init__(self, url: str) -> None:
        self.args = [sys.executable, "-c", HEAVY, url, AGENTS, str(HEAVY_TOKENS), str(HEAVY_IN_FLIGHT)]

    def __enter__(self) -> HeavyProcess:
        self.process = subprocess.Popen(self.args, stdin=subprocess.PIPE)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--in-process", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    model = make_tiny_model(work / "qwen3", "qwen3")
    keys = work / "keys.json"
    keys.write_text(json.dumps(KEYS))
    os.chmod(keys, 0o600)
    server = Server(
        "--model", str(model), "--api-keys-file", str(keys), "--max-batch", "4", "--max-waiting", "32",
        "--speculate", "off", log_path=work / "serve.log",
    )  # fmt: skip
    heavy = HeavyThreads if args.in_process else HeavyProcess
    rows = []
    try:
        server.start()
        client = httpx.Client(base_url=server.url, timeout=120)
        light(client)  # warms the path and opens the connection
        for round_ in range(args.rounds):
            alone = statistics.median(light(client) for _ in range(args.samples))
            with heavy(server.url):
                deadline = time.monotonic() + 60
                while in_flight(server) < HEAVY_IN_FLIGHT and time.monotonic() < deadline:
                    time.sleep(0.05)
                beside = statistics.median(light(client) for _ in range(args.samples))
            rows.append((alone, beside))
            print(f"round {round_ + 1}: alone {alone * 1e3:.1f} ms, beside 16 in flight {beside * 1e3:.1f} ms, "
                  f"{beside / alone:.2f}x", flush=True)  # fmt: skip
    finally:
        server.stop()
    ratios = [b / a for a, b in rows]
    where = "threads of this process" if args.in_process else "a process of their own"
    print(
        f"heavy clients in {where}: alone median {statistics.median(a for a, _ in rows) * 1e3:.1f} ms, beside "
        f"{statistics.median(b for _, b in rows) * 1e3:.1f} ms; ratio median {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}x over {len(rows)} rounds of {args.samples})"
    )


if __name__ == "__main__":
    main()
