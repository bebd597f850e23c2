"""Residency under load (issue 63): four models behind one router at ``--models-max 2``, clients asking for them at
random for some minutes. Nothing may be lost (every request answered whole, with the text that model gives that
prompt alone), nothing unloaded under a stream, and once every model is unloaded the memory must come back.

Run: .venv/bin/python bench/residency.py [--minutes 5] [--clients 4] [--models 4] [--models-max 2]

The models are the tests' tiny Qwen3 made with different seeds (so each answers differently), one rank each.
Each client loops: a model at random, a prompt and a length at random, streamed or not at random; greedy and to
its full length, so that every answer for the same (model, prompt, length) must be the same text, checked against
the first one seen. Memory: the router's resident set and the host's available memory (``/proc``), read before the
first load and after every model is unloaded at the end.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit import Server, make_tiny_model, sse_events  # noqa: E402

# Memory after every model is unloaded, against before the first load: the router's resident set may keep what its
# Python heap and its HTTP client's connection pool grew to; the host's available memory moves with every other
# process on it.
ROUTER_TOLERANCE = 8 << 20
HOST_TOLERANCE = 0.01
PROMPTS = ["The lamp", "Waves fold over", "A gull circles the", "Salt on the windows"]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def ask(url: str, model: str, prompt: str, tokens: int, stream: bool) -> tuple[str, str]:
    """The text and finish reason of one greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    if not stream:
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        if reply.status_code != 200:
            return "", f"status {reply.status_code}: {reply.text[:200]}"
        choice = reply.json()["choices"][0]
        return choice["text"], choice["finish_reason"]
    pieces, finish = [], ""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=600) as reply:
        for event in sse_events(reply):
            if isinstance(event, dict):
                if "error" in event:
                    return "".join(pieces), f"error event: {event['error']}"
                for choice in event["choices"]:
                    pieces.append(choice["text"])
                    finish = choice["finish_reason"] or finish
    return "".join(pieces), finish


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--models-max", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp())
    folders = [make_tiny_model(scratch / f"m{i}", "qwen3", seed=i) for i in range(args.models)]
    names = [folder.name for folder in folders]
    models = [flag for folder in folders for flag in ("--model", str(folder))]
    router = Server(*models, "--models-max", str(args.models_max), log_path=scratch / "router.log")
    seen: dict[tuple[str, str, int], str] = {}
    problems: list[str] = []
    asked = {"whole": 0, "streamed": 0}
    lock = threading.Lock()
    try:
        router.start()
        idle_rss, idle_available = rss(router.process.pid), available()
        deadline = time.monotonic() + args.minutes * 60

        def client(number: int) -> None:
            rng = random.Random(args.seed * 1000 + number)
            while time.monotonic() < deadline:
                model, prompt = rng.choice(names), rng.choice(PROMPTS)
                tokens, stream = rng.choice((8, 32, 96)), rng.random() < 0.5
                text, finish = ask(router.url, model, prompt, tokens, stream)
                with lock:
                    asked["streamed" if stream else "whole"] += 1
                    first = seen.setdefault((model, prompt, tokens), text)
                    if finish != "length" or text != first:
                        problems.append(f"{model} {prompt!r} {tokens} stream={stream}: {finish}, {text == first}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        busy_rss = rss(router.process.pid)
        for name in names:
            httpx.post(f"{router.url}/models/unload", json={"model": name}, timeout=600).raise_for_status()
        after_rss, after_available = rss(router.process.pid), available()
        swaps = router.metrics()[("neuron_model_swaps_total", ())]
        loads = sum(1 for e in router.logs() if e.get("event") == "model state" and e.get("state") == "loaded")
    finally:
        router.stop()
    total = asked["whole"] + asked["streamed"]
    print(f"{args.models} models, --models-max {args.models_max}, {args.clients} clients, {args.minutes:g} minutes")
    print(f"requests: {total} ({asked['streamed']} streamed), problems: {len(problems)}")
    for problem in problems[:10]:
        print("  ", problem)
    print(f"loads: {loads}, swaps: {swaps:.0f}")
    mib = 1 << 20
    print(f"router RSS: idle {idle_rss / mib:.1f} MiB, after the run {busy_rss / mib:.1f}, after unloading all")
    print(f"  {after_rss / mib:.1f} MiB ({(after_rss - idle_rss) / mib:+.1f})")
    print(f"host MemAvailable: before {idle_available / mib:.0f} MiB, after unloading all {after_available / mib:.0f}")
    print(f"  ({(after_available - idle_available) / mib:+.0f} MiB)")
    kept = after_rss - idle_rss > ROUTER_TOLERANCE or idle_available - after_available > idle_available * HOST_TOLERANCE
    if kept:
        print(f"memory did not come back within {ROUTER_TOLERANCE >> 20} MiB and {HOST_TOLERANCE:.0%}")
    sys.exit(1 if problems or kept else 0)


if __name__ == "__main__":
    main()
