"""Decode speed of one streaming HTTP client against raw mlx-lm, on the same model, in the same run.

Run: .venv/bin/python bench/http_decode.py [--model FOLDER] [--tokens 128] [--rounds 5] [--tp 1]

The baseline is ``mlx_lm.stream_generate`` in its own process with the same
BLAS neuron uses (OpenBLAS preloaded when present). The contender is a real
``neuron serve`` answering a streamed ``/v1/completions`` request. The two
alternate, round by round, so that the machine's noise hits both alike.
Decode rate is (tokens - 1) / (time from first to last token): prefill excluded.
Prints a markdown table; the ratio is what to trust, not the absolute rates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from streaming import stream_completion

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def baseline_child(model: str, tokens: int) -> None:
    """A persistent baseline: one greedy generation per line read on stdin, one JSON result per line out."""
    from mlx_lm import load, stream_generate

    loaded_model, tokenizer = load(model)
    for _ in sys.stdin:
        stamps = []
        for _response in stream_generate(loaded_model, tokenizer, PROMPT, max_tokens=tokens):
            stamps.append(time.perf_counter())
        print(json.dumps({"tokens": len(stamps), "seconds": stamps[-1] - stamps[0]}), flush=True)


def _blas_env() -> dict[str, str]:
    sys.path.insert(0, str(ROOT))
    from neuron import cpu

    env = dict(os.environ)
    if cpu.is_linux_cpu_backend() and (lib := cpu.find_openblas()):
        env["LD_PRELOAD"] = str(lib)
    return env


def http_round(url: str, model_id: str, tokens: int) -> dict:
    streamed = stream_completion(url, model_id, PROMPT, tokens)
    # Text can lag a token (a partial character), so time spans first to last text, counted in tokens.
    return {"tokens": streamed.tokens, "seconds": streamed.text_at[-1] - streamed.text_at[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", nargs=2, metavar=("MODEL", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help="model folder or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    if args.baseline:
        baseline_child(args.baseline[0], int(args.baseline[1]))
        return

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT))
    from conftest import Server

    from neuron.models import model_id, resolve

    path = resolve(args.model)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"neuron-bench-{os.getpid()}.log"
    served_id = model_id(args.model)
    server = Server(*(["--model", args.model] if args.model else []), "--tp", str(args.tp), log_path=log)
    baseline = subprocess.Popen(
        [sys.executable, __file__, "--baseline", str(path), str(args.tokens)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_blas_env(),
        cwd=ROOT,
    )
    assert baseline.stdin is not None and baseline.stdout is not None
    try:
        server.start()
        results: dict[str, list[dict]] = {"mlx_lm": [], "http": []}
        for warmup in (True,) + (False,) * args.rounds:
            baseline.stdin.write("go\n")
            baseline.stdin.flush()
            raw = json.loads(baseline.stdout.readline())
            served = http_round(server.url, served_id, args.tokens)
            if not warmup:
                results["mlx_lm"].append(raw)
                results["http"].append(served)
    finally:
        baseline.stdin.close()
        baseline.wait(timeout=60)
        server.stop()
        log.unlink(missing_ok=True)

    def rate(r: dict) -> float:
        return (r["tokens"] - 1) / r["seconds"]

    base = statistics.median(rate(r) for r in results["mlx_lm"])
    http = statistics.median(rate(r) for r in results["http"])
    print(f"model {path.name}, TP={args.tp}, {args.tokens} tokens, median of {args.rounds} alternating rounds\n")
    print("| path | decode tok/s (median) | tokens/round | vs mlx_lm |")
    print("|---|---|---|---|")
    print(f"| mlx_lm.stream_generate | {base:.1f} | {results['mlx_lm'][0]['tokens']} | 1.00x |")
    print(f"| neuron serve, one streaming client | {http:.1f} | {results['http'][0]['tokens']} | {http / base:.2f}x |")


if __name__ == "__main__":
    main()
