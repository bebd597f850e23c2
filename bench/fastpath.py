"""The Linux CPU fast path: prefill and decode with the wheel's reference BLAS and with OpenBLAS, beside the
memory-bandwidth limit of this machine.

Run: .venv/bin/python bench/fastpath.py [--model FOLDER_OR_GGUF] [--prompt 128] [--tokens 32]

Each BLAS runs in a fresh process (a BLAS can only be chosen before MLX loads):
mlx-lm's model, greedy, a ``--prompt``-token prefill timed whole, then
``--tokens`` decode steps (median), and the BLAS alone on the prefill's most
common product (the GEMM column: what bounds the prefill ratio). OpenBLAS runs
with two threads, as neuron's TP=1 leader leaves it. The bandwidth rows read a 1 GiB buffer with numpy, one
process per core at once; the decode limit is the model's weight bytes divided
by that, since every decode step reads every weight once.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_model(model: str, prompt: int, tokens: int) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from neuron.system import cpu

    loaded, _ = load_model(Path(model), lazy=False)
    ids = mx.array([[(7 * i + 3) % 200 + 10 for i in range(prompt)]])
    mx.eval(loaded(ids[:, :8], cache=make_prompt_cache(loaded)))  # warm-up
    cache = make_prompt_cache(loaded)
    started = time.perf_counter()
    token = mx.argmax(loaded(ids, cache=cache)[0, -1])
    mx.eval(token)
    prefill = time.perf_counter() - started
    steps = []
    for _ in range(tokens):
        started = time.perf_counter()
        token = mx.argmax(loaded(token.reshape(1, 1), cache=cache)[0, -1])
        mx.eval(token)
        steps.append(time.perf_counter() - started)
    return {
        "prefill_tok_s": prompt / prefill,
        "decode_ms": statistics.median(steps) * 1000,
        "gemm_gflops": gemm_gflops(prompt, loaded.args.hidden_size, loaded.args.intermediate_size),
        "blas": cpu.blas_in_use(),
    }


def gemm_gflops(m: int, k: int, n: int, repeats: int = 10) -> float:
    """The BLAS alone, on the prefill's most common product: (prompt x hidden) @ (hidden x MLP)."""
    import mlx.core as mx

    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a, b, a @ b)
    started = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    return 2 * m * k * n * repeats / (time.perf_counter() - started) / 1e9


def read_bandwidth() -> float:
    """GB/s one process reads from a 1 GiB buffer (best of 5 passes)."""
    import numpy as np

    buffer = np.ones(1 << 28, dtype=np.float32)
    best = 0.0
    for _ in range(5):
        started = time.perf_counter()
        buffer.sum()
        best = max(best, buffer.nbytes / (time.perf_counter() - started) / 1e9)
    return best


def _child(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _result(process: subprocess.Popen[str]) -> dict:
    out, _ = process.communicate(timeout=1800)
    if process.returncode != 0:
        raise RuntimeError(f"{process.args} exited {process.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder or .gguf (default: the embedded SmolLM2, converted to fp32)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--run", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--bandwidth", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_model(args.run[0], int(args.run[1]), int(args.run[2]))))
        return
    if args.bandwidth:
        print(json.dumps({"gb_s": read_bandwidth()}))
        return

    from neuron.models.folder import resolve
    from neuron.system import cpu

    model = resolve(args.model)
    weight_bytes = sum(f.stat().st_size for f in model.glob("model*.safetensors"))
    library = cpu.find_blas()
    stock = {k: v for k, v in os.environ.items() if k != cpu.PRELOAD_ENV}
    fast = {**stock, cpu.PRELOAD_ENV: library or "", "OPENBLAS_NUM_THREADS": "2"}
    run = ("--run", str(model), str(args.prompt), str(args.tokens))
    reference = _result(_child(*run, env=stock))
    openblas = _result(_child(*run, env=fast)) if library else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    one = _result(_child("--bandwidth", env=stock))["gb_s"]
    together = sum(r["gb_s"] for r in [_result(p) for p in [_child("--bandwidth", env=stock) for _ in range(cores)]])

    print(
        f"model {model.name}: {weight_bytes / 1e6:.0f} MB of weights; "
        f"prompt {args.prompt}, {args.tokens} decode steps\n"
    )
    print(
        "| BLAS | prefill tok/s | decode ms/token | GEMM GFLOP/s | prefill vs stock | decode vs stock | GEMM vs stock |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in (("", reference), (", 2 threads", openblas)):
        if r is None:
            continue
        print(
            f"| {r['blas']}{name} | {r['prefill_tok_s']:.0f} | {r['decode_ms']:.1f} | {r['gemm_gflops']:.0f} "
            f"| {r['prefill_tok_s'] / reference['prefill_tok_s']:.1f}x "
            f"| {reference['decode_ms'] / r['decode_ms']:.2f}x | {r['gemm_gflops'] / reference['gemm_gflops']:.1f}x |"
        )
    print()
    print("| memory read bandwidth | GB/s | decode floor (weights / bandwidth), ms/token |")
    print("|---|---|---|")
    print(f"| one core | {one:.1f} | {weight_bytes / one / 1e6:.1f} |")
    print(f"| all {cores} cores at once | {together:.1f} | {weight_bytes / together / 1e6:.1f} |")
    if openblas:
        achieved = weight_bytes / (openblas["decode_ms"] / 1000) / 1e9
        print(
            f"\nOpenBLAS decode reads weights at {achieved:.1f} GB/s, "
            f"{achieved / together:.0%} of the all-core bandwidth."
        )


if __name__ == "__main__":
    main()
