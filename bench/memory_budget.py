"""The memory budget under the issue's scenario: the embedded SmolLM2 at TP=1 in a memory cgroup, eight concurrent
requests of about 4,200 prompt tokens and 300 out, against the same server without a limit, in the same run.

Run: .venv/bin/python bench/memory_budget.py [--limit-mib 1536 --requests 8 --prompt-tokens 4200 --max-tokens 300]
(as root: each server starts in a memory cgroup of its own, testkit/cgroups.py; the unlimited one's is 16 GiB).

Prints markdown tables: the budget and where each rank's memory goes, as the limited server logged it at start;
each run's time, ratio to the unlimited run, preemptions, requests that waited, texts equal to the unlimited run's,
OOM kills, and the cgroup's peak against what neuron planned (its total less the headroom); and what one
preemption cost: the tokens fed again when it resumed, the time from its pause to its next token, and the replay's
share of that at the prefill rate the same run measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit import cgroups  # noqa: E402
from testkit.server import Server  # noqa: E402

MIB = 1 << 20
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers and then".split()


def prompt(server: Server, model: str, i: int, tokens: int) -> str:
    """Distinct prompts of about ``tokens`` tokens (counted by the server's own ``/tokenize``)."""
    words = [f"{i}:"]
    while True:
        words += [WORDS[(i + len(words)) % len(WORDS)] for _ in range(256)]
        text = " ".join(words)
        count = httpx.post(f"{server.url}/tokenize", json={"model": model, "prompt": text}, timeout=60).json()["count"]
        if count >= tokens:
            return text


def run(args: argparse.Namespace, limit: int, name: str) -> dict:
    group = cgroups.MemoryLimit(f"neuron-bench-{name}", limit)
    log = Path(args.logs) / f"{name}.log"
    server = Server(*args.serve, log_path=log, cgroup_procs=group.procs)
    try:
        server.start()
        idle = group.usage()
        group.reset_peak()
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        prompts = [prompt(server, model, i, args.prompt_tokens) for i in range(args.requests)]

        def ask(text: str) -> httpx.Response:
            body = {"model": model, "prompt": text, "max_tokens": args.max_tokens, "temperature": 0.0}
            return httpx.post(f"{server.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=7200)

        started = time.perf_counter()
        with ThreadPoolExecutor(args.requests) as pool:
            replies = list(pool.map(ask, prompts))
        seconds = time.perf_counter() - started
        logs = server.logs()
        budget = server.find_log("memory budget")
        assert budget is not None
        (rank0,) = [r for r in budget["ranks"] if r["rank"] == 0]
        fresh = [e for e in logs if e.get("event") == "prefill done" and not e.get("cached_tokens")]
        prefill_rate = sum(e["prompt_tokens"] for e in fresh) / sum(e["ms"] / 1000 for e in fresh) if fresh else 0.0
        return {
            "seconds": seconds,
            "idle": idle,
            "peak": group.peak() or 0,
            "oom": group.oom_kills(),
            "status": [r.status_code for r in replies],
            "texts": [r.json()["choices"][0]["text"] if r.status_code == 200 else None for r in replies],
            "preempted": [e for e in logs if e.get("event") == "preempted"],
            "resumed": [e for e in logs if e.get("event") == "resumed"],
            "waited": [e["waited_ms"] for e in logs if e.get("event") == "request started"],
            "budget": budget,
            "planned": rank0["total_bytes"] - rank0["headroom_bytes"],
            "prefill_rate": prefill_rate,
        }
    finally:
        server.stop()
        group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=int, default=1536)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=4200)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--logs", default="/tmp")
    parser.add_argument("serve", nargs="*", help="more arguments for neuron serve (after --)")
    args = parser.parse_args()
    if problem := cgroups.unavailable():
        sys.exit(f"memory_budget.py: {problem}")
    free = run(args, 16 << 30, "unlimited")
    limited = run(args, args.limit_mib * MIB, "limited")

    budget = limited["budget"]
    print(f"\n{args.requests} requests of {args.prompt_tokens} prompt tokens and {args.max_tokens} out, greedy\n")
    print("| rank | total | used at start | free | kept for a step | images | headroom | budget | longest sequence |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rank in budget["ranks"]:
        mib = {k: f"{v / MIB:.0f} MiB" for k, v in rank.items() if k.endswith("_bytes")}
        print(
            f"| {rank['rank']} | {mib['total_bytes']} | {mib['used_bytes']} | {mib['free_bytes']} | "
            f"{mib['steps_bytes']} | {mib['images_bytes']} | {mib['headroom_bytes']} | {mib['budget_bytes']} | "
            f"{rank['longest_tokens']} tokens |"
        )
    print("\n| run | limit | seconds | vs unlimited | answered | texts as unlimited | preempted | waited > 1 s | "
          "OOM kills | cgroup peak | planned |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, result, limit in (("unlimited", free, 16 << 10), ("limited", limited, args.limit_mib)):
        same = sum(a == b for a, b in zip(result["texts"], free["texts"], strict=True))
        print(
            f"| {name} | {limit} MiB | {result['seconds']:.1f} | {result['seconds'] / free['seconds']:.2f}x | "
            f"{result['status'].count(200)}/{args.requests} | {same}/{args.requests} | {len(result['preempted'])} | "
            f"{sum(w > 1000 for w in result['waited'])} | {result['oom']} | {result['peak'] / MIB:.0f} MiB | "
            f"{result['planned'] / MIB:.0f} MiB |"
        )
    resumed = [e for e in limited["resumed"] if e["reason"] == "memory"]
    if resumed:
        replayed = statistics.median(e["replayed_tokens"] for e in resumed)
        paused_s = statistics.median(e["ms"] for e in resumed) / 1000
        replay_s = replayed / limited["prefill_rate"] if limited["prefill_rate"] else float("nan")
        print("\n| preemptions | tokens fed again (median) | pause to next token, s (median) | of which the replay, s "
              "(at the run's prefill rate) | prefill rate, tok/s |")  # fmt: skip
        print("|---|---|---|---|---|")
        print(f"| {len(resumed)} | {replayed:.0f} | {paused_s:.1f} | {replay_s:.1f} | {limited['prefill_rate']:.0f} |")


if __name__ == "__main__":
    main()
