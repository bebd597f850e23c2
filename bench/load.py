"""A load run: 32 concurrent streaming clients for 3 minutes against a TP=2 server on the tiny model.

Run: .venv/bin/python bench/load.py [--clients 32] [--minutes 3] [--tp 2]

Each client loops: a random prompt, a random max_tokens in [8, 64], a streamed
/v1/completions request read to [DONE]. Every HTTP error, error event, or stream
without [DONE] counts as an error. Every second the script samples the leader's
and each worker's RSS; the table compares the mean RSS over the last 20 s of
minute 1 with the same window at the end of the run. Leaking per request shows
as growth between the two; the first minute is left for warm-up (allocator pools,
MLX's buffer cache, compiled kernels).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = "the cat sat on a mat while one two three dogs ran far away into good morning light".split()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def client(url: str, rng: random.Random, until: float, counts: dict[str, int], errors: list[str]) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < until:
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
            body = {"model": "qwen3", "prompt": prompt, "max_tokens": rng.randint(8, 64), "stream": True}
            done = False
            try:
                async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        errors.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                        continue
                    async for line in response.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: ") and '"error"' in line:
                            errors.append(line[:300])
                        elif line.startswith("data: "):
                            counts["chunks"] += 1
            except httpx.HTTPError as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            counts["requests"] += 1
            if not done:
                errors.append(f"a stream ended without [DONE] ({prompt!r})")


async def sample(pids: dict[str, int], until: float, samples: list[tuple[float, dict[str, float]]]) -> None:
    start = time.monotonic()
    while time.monotonic() < until:
        samples.append((time.monotonic() - start, {name: rss_mb(pid) for name, pid in pids.items()}))
        await anyio.sleep(1.0)


def window(samples: list[tuple[float, dict[str, float]]], end: float, name: str, width: float = 20.0) -> float:
    return statistics.mean(rss[name] for t, rss in samples if end - width <= t <= end)


async def run(url: str, pids: dict[str, int], clients: int, seconds: float, seed: int) -> None:
    counts = {"requests": 0, "chunks": 0}
    errors: list[str] = []
    samples: list[tuple[float, dict[str, float]]] = []
    until = time.monotonic() + seconds
    async with anyio.create_task_group() as tg:
        tg.start_soon(sample, pids, until, samples)
        for i in range(clients):
            tg.start_soon(client, url, random.Random(seed * 1000 + i), until, counts, errors)
    last = samples[-1][0]
    print(f"{clients} clients, {seconds / 60:g} min: {counts['requests']} requests, {counts['chunks']} text chunks, ")
    print(f"{len(errors)} errors" + (f"; first: {errors[0]}" if errors else ""))
    print()
    print("| process | RSS at minute 1 (MB) | RSS at the end (MB) | end / minute 1 |")
    print("|---|---|---|---|")
    for name in pids:
        early, late = window(samples, 60.0, name), window(samples, last, name)
        print(f"| {name} | {early:.1f} | {late:.1f} | {late / early:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    from testkit import Server, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "qwen3", "qwen3")
        server = Server("--model", str(model), "--tp", str(args.tp), log_path=Path(tmp) / "log").start()
        try:
            pids = {"leader (rank 0)": server.process.pid}
            workers = [e["pid"] for e in server.logs() if e.get("event") == "worker started"]
            pids |= {f"worker (rank {rank})": pid for rank, pid in enumerate(workers, start=1)}
            anyio.run(run, server.url, pids, args.clients, args.minutes * 60, args.seed)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
