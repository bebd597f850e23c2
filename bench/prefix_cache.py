"""Time to first token with the prefix cache on and off, and against ``mlx_lm.server``'s prompt cache, in one run.

Run: .venv/bin/python bench/prefix_cache.py [--model FOLDER] [--tp 1]

Three servers on the same model folder: ``neuron serve`` with its prefix cache
(the default budget), ``neuron serve --prefix-cache-bytes 0``, and
``mlx_lm.server`` (its prompt cache on, as by default). Two scenarios, each
streamed and greedy, one server at a time so they never share the cores:

- shared prefix: two chat requests whose first 1,500 or so tokens are the same
  (a long system prompt), differing in the question; TTFT of each, and the
  second's ``cached_tokens``;
- a four-turn chat (a system prompt of about 1,000 tokens, each turn resending
  the whole conversation with the previous reply): TTFT of every turn.

Each server's conversation uses its own replies (greedy, so the same text where
the servers agree). TTFT is from sending the request to the first text event.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from concurrency import start_mlx_lm_server
from streaming import events

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHARED = " ".join(f"Policy {i}: keep answers short, cite the rule you follow, and stay polite." for i in range(80))
SYSTEM = " ".join(f"Rule {i}: answer briefly and kindly." for i in range(100))
TURNS = ["Hello there.", "Tell me more about rule 3.", "And rule 7?", "Thanks, that is all."]


def chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str, dict]:
    """TTFT in seconds, the reply's text, and its usage."""
    started, first, text, usage = time.perf_counter(), None, "", {}
    for event in events(url, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": max_tokens}):
        usage = event.get("usage") or usage
        piece = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
        if piece:
            first = first or time.perf_counter()
            text += piece
    return (first or time.perf_counter()) - started, text, usage


def cached(usage: dict) -> str:
    details = usage.get("prompt_tokens_details") or {}
    return str(details.get("cached_tokens", "n/a"))


def scenarios(url: str, model: str) -> dict[str, list[tuple[float, str]]]:
    """Each scenario's rows: TTFT and cached tokens, in order."""
    out: dict[str, list[tuple[float, str]]] = {"shared": [], "chat": []}
    for question in ("Which policy covers greetings?", "Which policy covers refunds?"):
        ttft, _, usage = chat(
            url, model, [{"role": "system", "content": SHARED}, {"role": "user", "content": question}], 8
        )
        out["shared"].append((ttft, cached(usage)))
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        ttft, text, usage = chat(url, model, messages, 16)
        out["chat"].append((ttft, cached(usage)))
        messages.append({"role": "assistant", "content": text})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="model folder (default: the embedded SmolLM2, converted to fp32)")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()

    from neuron.models.folder import model_id, resolve
    from testkit import Server

    path = resolve(args.model)
    neuron_id = model_id(args.model)
    model_args = [*(["--model", args.model] if args.model else []), "--tp", str(args.tp)]
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    results: dict[str, dict[str, list[tuple[float, str]]]] = {}
    for name, extra in (("neuron, cache on", []), ("neuron, cache off", ["--prefix-cache-bytes", "0"])):
        log = logs / f"neuron-bench-prefix-{os.getpid()}.log"
        server = Server(*model_args, *extra, log_path=log)
        try:
            server.start()
            chat(server.url, neuron_id, [{"role": "user", "content": "Warm up."}], 2)
            results[name] = scenarios(server.url, neuron_id)
        finally:
            server.stop()
            log.unlink(missing_ok=True)
    mlx, url = start_mlx_lm_server(path)
    try:
        chat(url, str(path), [{"role": "user", "content": "Warm up."}], 2)
        results["mlx_lm.server"] = scenarios(url, str(path))
    finally:
        mlx.terminate()
        mlx.wait(timeout=60)

    print(f"model {path.name}, neuron TP={args.tp}, streamed greedy chat, one run\n")
    print("| scenario | request | " + " | ".join(f"{name}: TTFT ms (cached)" for name in results) + " |")
    print("|---|---|" + "---|" * len(results))
    rows = [("shared 1,500-token prefix", f"request {i + 1}", "shared", i) for i in range(2)]
    rows += [("4-turn chat", f"turn {i + 1}", "chat", i) for i in range(len(TURNS))]
    for scenario, label, key, i in rows:
        cells = [f"{r[key][i][0] * 1000:.0f} ({r[key][i][1]})" for r in results.values()]
        print(f"| {scenario} | {label} | " + " | ".join(cells) + " |")
    on = results["neuron, cache on"]["shared"]
    print(f"\nshared prefix, neuron with the cache: second TTFT / first = {on[1][0] / on[0][0]:.2f}")


if __name__ == "__main__":
    main()
