"""A short request sent while a long prompt is fed: its time to first token against an idle server's, the long
prompt's own time, and how many steps ran between the short request's arrival and its first token (issue 64 item 2).

Run: .venv/bin/python bench/head_of_line.py [--prompt-tokens 8141] [--after 3] [--model FOLDER]

One ``neuron serve`` (TP=1, the prefix cache off so that every prompt is computed, its steps logged). The short
request (a few prompt tokens, 2 tokens out, streamed) is timed alone three times; then a prompt of
``--prompt-tokens`` tokens (1 token out) is sent, and ``--after`` seconds into its prefill the short request again.
The model is the embedded SmolLM2-135M unless ``--model`` names a folder.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit import Server, sse_events  # noqa: E402

SHORT = "Name a colour."


def first_token_s(url: str, model: str) -> tuple[float, float]:
    """The short request: when it was sent (perf_counter) and its time to first token, in seconds."""
    body = {"model": model, "prompt": SHORT, "max_tokens": 2, "temperature": 0.0, "stream": True}
    sent = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        for event in sse_events(reply):
            if isinstance(event, dict) and event["choices"][0]["text"]:
                return sent, time.perf_counter() - sent
    raise RuntimeError("the short request gave no text")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=8141)
    parser.add_argument("--after", type=float, default=3.0, help="seconds into the long prefill the short is sent")
    parser.add_argument("--model", type=Path)
    args = parser.parse_args()
    if args.model is None:
        from neuron.models.folder import resolve

        args.model = resolve(None)
    log = Path(tempfile.mkdtemp()) / "serve.log"
    server = Server("--model", str(args.model), "--prefix-cache-bytes", "0", "--log-level", "trace", log_path=log)
    name = args.model.name
    try:
        server.start()
        first_token_s(server.url, name)  # warms the path
        idle = statistics.median(first_token_s(server.url, name)[1] for _ in range(3))
        prompt = [(7 * i) % 1000 + 100 for i in range(args.prompt_tokens)]
        long_s: list[float] = []

        def long_request() -> None:
            started = time.perf_counter()
            body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=3600)
            assert reply.status_code == 200, reply.text
            long_s.append(time.perf_counter() - started)

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(args.after)  # a bench, not a test: the short request is meant to land mid-prefill
        _, during = first_token_s(server.url, name)
        thread.join()
        steps = [e for e in server.logs() if e.get("event") == "step"]
    finally:
        server.stop()
    budgets = [(e["prefill_tokens"], e["ms"]) for e in steps if e["prefill_tokens"]]
    print(f"model {name}, a {args.prompt_tokens}-token prompt, the short request sent {args.after} s into it")
    print(f"long prompt: {long_s[0]:.1f} s to its answer, in {len(budgets)} prompt steps")
    print(f"short request's time to first token: idle {idle * 1e3:.0f} ms, during the long prefill {during:.2f} s")
    print(f"  = {during / long_s[0]:.3f} of the long prompt's time (the issue's bound: 0.25)")
    print("prompt steps (tokens fed, ms):", ", ".join(f"{t}/{ms:.0f}" for t, ms in budgets))


if __name__ == "__main__":
    main()
