"""Aggregate decode throughput and time to first token at 1, 2, 4 and 8 concurrent streams:
``neuron serve`` against ``mlx_lm.server`` on the same model folder, started by this script in the same run.

Run: .venv/bin/python bench/concurrency.py [--model FOLDER] [--tokens 64] [--rounds 2] [--tp 1] [--serve FLAGS]
         [--also FLAGS ...] [--checkout DIR]

Each level sends that many streamed, greedy ``/v1/completions`` requests at
once (different prompts), and measures the round's wall time, every stream's
time to first token, and the completion tokens (``usage``; else one per text
chunk). Aggregate tok/s = all completion tokens / the round's wall time. The
two servers alternate level by level, so the machine's noise hits both alike;
each figure is the median over ``--rounds``. Both run greedy and stop at end of
sequence, so they generate the same text.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from http_decode import blas_env
from streaming import stream_completion

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The history of the Roman Empire begins with",
    "In the middle of the forest stood an old house where",
    "The recipe for a good loaf of bread starts with",
    "Long ago, a young sailor set out to find",
    "The first thing every gardener should know is",
    "On a cold winter night, the old clock tower",
    "Scientists have long wondered why the ocean",
]
LEVELS = (1, 2, 4, 8)


def level(url: str, model: str, concurrency: int, tokens: int) -> dict:
    results: list[dict] = [{}] * concurrency

    def one(i: int) -> None:
        streamed = stream_completion(url, model, PROMPTS[i % len(PROMPTS)], tokens)
        first = streamed.text_at[0] if streamed.text_at else time.perf_counter()
        results[i] = {"ttft": first - streamed.started, "tokens": streamed.tokens}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return {
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50": statistics.median(r["ttft"] for r in results),
        "tokens": sum(r["tokens"] for r in results),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, alive: Callable[[], bool], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server behind {url} exited")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up within {timeout} s")


def start_mlx_lm_server(path: Path) -> tuple[subprocess.Popen, str]:
    """``mlx_lm.server`` on the model folder ``path``, with the BLAS neuron uses, on a free port; returns the
    process and its URL once it answers."""
    env = blas_env()
    port = _free_port()
    mlx = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", str(path), "--port", str(port), "--log-level", "WARNING"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url, lambda: mlx.poll() is None)
    except BaseException:
        mlx.terminate()
        raise
    return mlx, url


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="model folder (default: the embedded SmolLM2, converted to fp32)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--serve", default="", metavar="FLAGS", help="extra flags for neuron serve ('--run-ahead on')")
    parser.add_argument(
        "--checkout", metavar="DIR", help="also a neuron serve run from another checkout of neuron (an earlier commit)"
    )
    parser.add_argument(
        "--also", action="append", default=[], metavar="FLAGS", help="also a neuron serve with these flags; repeatable"
    )
    args = parser.parse_args()

    from neuron.models.folder import model_id, resolve
    from testkit import Server

    path = resolve(args.model)
    neuron_id = model_id(args.model)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"neuron-bench-{os.getpid()}"
    flags = [*(["--model", args.model] if args.model else []), "--tp", str(args.tp), *args.serve.split()]
    neurons = {"neuron serve": Server(*flags, log_path=log.with_suffix(".log"))}
    for i, extra in enumerate(args.also):
        neurons[f"neuron serve {extra}"] = Server(*flags, *extra.split(), log_path=log.with_suffix(f".{i}.log"))
    if args.checkout:
        # PYTHONSAFEPATH: ``python -m neuron`` must not import this checkout from its working directory.
        env = {"PYTHONPATH": str(Path(args.checkout).resolve()), "PYTHONSAFEPATH": "1"}
        checkout_log = log.with_suffix(".checkout.log")
        neurons[f"neuron serve from {args.checkout}"] = Server(*flags, log_path=checkout_log, env=env)
    mlx, mlx_url = start_mlx_lm_server(path)
    try:
        servers = {"mlx_lm.server": (mlx_url, str(path))}
        for name, server in neurons.items():
            servers[name] = (server.start().url, neuron_id)
        for url, model in servers.values():
            level(url, model, 2, 8)  # warm up
        figures: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.rounds):
            for concurrency in LEVELS:
                for name, (url, model) in servers.items():
                    figures.setdefault((name, concurrency), []).append(level(url, model, concurrency, args.tokens))
    finally:
        mlx.terminate()
        mlx.wait(timeout=60)
        for server in neurons.values():
            server.stop()
            server.log_path.unlink(missing_ok=True)

    def median(name: str, concurrency: int, key: str) -> float:
        return statistics.median(r[key] for r in figures[(name, concurrency)])

    single = median("neuron serve", 1, "tok_s")
    print(
        f"model {path.name}, neuron TP={args.tp} {args.serve}, {args.tokens} tokens per stream, "
        f"median of {args.rounds} rounds\n"
    )
    print("| streams | server | aggregate tok/s | TTFT p50 (ms) | vs mlx_lm.server | vs neuron at 1 stream |")
    print("|---|---|---|---|---|---|")
    for concurrency in LEVELS:
        base = median("mlx_lm.server", concurrency, "tok_s")
        for name in servers:
            rate = median(name, concurrency, "tok_s")
            ttft = median(name, concurrency, "ttft_p50") * 1000
            print(f"| {concurrency} | {name} | {rate:.1f} | {ttft:.0f} | {rate / base:.2f}x | {rate / single:.2f}x |")


if __name__ == "__main__":
    main()
