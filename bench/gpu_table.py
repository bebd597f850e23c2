"""The GPU table in one command: neuron serve against mlx-lm on 1B- and 8B-shaped bf16 models, 1 and 8 streams.

Run (on a machine with an NVIDIA GPU and MLX for CUDA, ``../shared/gpu/README.md``):
    python bench/gpu_table.py [--shapes 1b 8b] [--tokens 128] [--rounds 3] [--skip-tests]
Through every step on a CPU, with small shapes: python bench/gpu_table.py --allow-cpu

Steps, in order:
1. Refuses to go on without a GPU (MLX's default device is the CPU), unless ``--allow-cpu``.
2. Generates each shape's random-weight bf16 qwen3 (a layer per file, so that an 8B never sits in memory twice).
3. For each shape, baselines in processes of their own that stay loaded: ``mlx_lm.stream_generate`` for one
   stream and ``mlx_lm``'s ``batch_generate`` for 8 streams. Then each ``neuron serve`` variant in turn (the
   default, run-ahead on and off, speculation off, the prefix cache off, both off), its rounds alternating with
   the baselines' so that the machine's drift hits both alike.
4. Prints the ratios table: one stream's decode tok/s (first to last token) against ``stream_generate``; 8
   streams' aggregate tok/s (the round's wall time, prefill included) against ``batch_generate``.
5. Runs the tests marked ``gpu`` (``pytest -m gpu`` over the modules that carry the mark).

The goals (issue 49): >= 0.9x ``stream_generate`` on the 8B shape, >= 0.9x ``batch_generate`` at 8 streams.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from concurrency import PROMPTS, level
from http_decode import blas_env, http_round, persistent, take_round

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


SHAPES = {  # Llama-3.2-1B's and Llama-3.1-8B's / Qwen3-8B's widths
    "1b": Shape(2048, 16, 32, 8, 64, 8192),
    "8b": Shape(4096, 32, 32, 8, 128, 14336),
}
CPU_SHAPES = {  # the same steps on a CPU, in seconds rather than hours
    "1b": Shape(256, 4, 4, 2, 64, 512),
    "8b": Shape(512, 4, 8, 2, 64, 1024),
}
VARIANTS = {
    "neuron serve": [],
    "--run-ahead on": ["--run-ahead", "on"],
    "--run-ahead off": ["--run-ahead", "off"],
    "--speculate off": ["--speculate", "off"],
    "--prefix-cache-bytes 0": ["--prefix-cache-bytes", "0"],
    "--speculate off --prefix-cache-bytes 0": ["--speculate", "off", "--prefix-cache-bytes", "0"],
}


def gpu_problem() -> str | None:
    """Why this machine cannot make the GPU table, or None."""
    import mlx.core as mx

    if mx.default_device().type == mx.gpu:
        return None
    return (
        "no GPU: MLX's default device is the CPU here. Install MLX for CUDA (mlx-cuda-13, see "
        "../shared/gpu/README.md) on a machine with an NVIDIA GPU, or pass --allow-cpu to run every step on this "
        "CPU with small shapes"
    )


def generate(folder: Path, shape: Shape, vocab: int) -> Path:
    """A random-weight bf16 qwen3 of ``shape`` with the tests' tokenizer, written a layer per file."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from testkit.models import tokenizer_files

    folder.mkdir(parents=True)
    vocab = max(tokenizer_files(folder), vocab)
    config = {
        "model_type": "qwen3",
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "intermediate_size": shape.intermediate,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))  # MLX is lazy: nothing is computed until a file is written
    weights = dict(tree_flatten(model.parameters()))
    groups: dict[str, dict[str, mx.array]] = {}
    for name, value in weights.items():
        parts = name.split(".")
        key = ".".join(parts[:3]) if parts[1:2] == ["layers"] else "rest"
        # Larger than the default init, as the tests' models: greedy text then wanders instead of repeating.
        groups.setdefault(key, {})[name] = (value * 4.0 if value.ndim == 2 else value).astype(mx.bfloat16)
    index = {}
    for i, group in enumerate(groups.values()):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        mx.save_safetensors(str(folder / file), group, metadata={"format": "mlx"})
        index.update(dict.fromkeys(group, file))
        mx.clear_cache()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (folder / "config.json").write_text(json.dumps(config))
    # MLX keeps freed buffers for reuse: without this, the 8B's weights stay on the GPU beside the servers it runs.
    del model, weights, groups, group
    mx.clear_cache()
    return folder


def batch_child(model: str, tokens: int, streams: int) -> None:
    """A persistent batch baseline: ``batch_generate`` over ``streams`` prompts per stdin line; one JSON line out."""
    from mlx_lm import load
    from mlx_lm.generate import batch_generate

    loaded, tokenizer = load(model)
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(streams)]
    for _ in sys.stdin:
        started = time.perf_counter()
        response = batch_generate(loaded, tokenizer, prompts, max_tokens=tokens, return_token_ids=True)
        seconds = time.perf_counter() - started
        made = sum(len(ids) for ids in response.token_ids or [])
        print(json.dumps({"tokens": made, "seconds": seconds}), flush=True)


def _batch_process(path: Path, tokens: int, streams: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--batch-child", str(path), str(tokens), str(streams)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=blas_env(),
        cwd=ROOT,
    )


def measure(name: str, path: Path, args: argparse.Namespace, scratch: Path) -> dict[tuple[int, str], float]:
    """Each path's median tok/s for ``path``, by (streams, path)."""
    from neuron.models.folder import model_id
    from testkit import Server

    served = model_id(str(path))
    results: dict[tuple[int, str], list[float]] = {}
    stream = persistent("--baseline", path, args.tokens)
    batch = _batch_process(path, args.tokens, 8)

    def baseline_round() -> None:
        one = take_round(stream)
        results.setdefault((1, "mlx_lm.stream_generate"), []).append((one["tokens"] - 1) / one["seconds"])
        many = take_round(batch)
        results.setdefault((8, "mlx_lm batch_generate"), []).append(many["tokens"] / many["seconds"])

    try:
        baseline_round()  # warm
        for label, flags in VARIANTS.items():
            server = Server("--model", str(path), *flags, log_path=scratch / f"{name}-{len(results)}.log")
            try:
                server.start()
                http_round(server.url, served, 16, server.process.pid)  # warm
                level(server.url, served, 8, 16)
                for _ in range(args.rounds):
                    baseline_round()
                    one = http_round(server.url, served, args.tokens, server.process.pid)
                    results.setdefault((1, label), []).append((one["tokens"] - 1) / one["seconds"])
                    results.setdefault((8, label), []).append(level(server.url, served, 8, args.tokens)["tok_s"])
            finally:
                server.stop()
            # As it goes, so that a run cut short by its machine's time limit still leaves figures.
            so_far = {key: statistics.median(rates) for key, rates in results.items()}
            for streams, base in ((1, "mlx_lm.stream_generate"), (8, "mlx_lm batch_generate")):
                rate = so_far[(streams, label)]
                print(f"{name} {streams} {label}: {rate:.1f} tok/s, {rate / so_far[(streams, base)]:.2f}x", flush=True)
    finally:
        for child in (stream, batch):
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=120)
    return {key: statistics.median(rates) for key, rates in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--allow-cpu", action="store_true", help="run every step on the CPU, with small shapes")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per neuron serve variant")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the test tokenizer's 259)")
    parser.add_argument("--keep", metavar="DIR", help="generate the models in DIR and keep them (reused when there)")
    parser.add_argument("--skip-tests", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.batch_child:
        batch_child(args.batch_child[0], int(args.batch_child[1]), int(args.batch_child[2]))
        return

    problem = gpu_problem()
    if problem and not args.allow_cpu:
        raise SystemExit(f"gpu_table: {problem}")
    shapes = CPU_SHAPES if problem else SHAPES
    scratch = Path(tempfile.mkdtemp())
    models = Path(args.keep) if args.keep else scratch / "models"
    table: dict[str, dict[tuple[int, str], float]] = {}
    try:
        for name in args.shapes:
            shape = shapes[name]
            folder = models / f"qwen3-{name}-bf16"
            if not (folder / "config.json").is_file():
                started = time.perf_counter()
                generate(folder, shape, args.vocab)
                print(f"generated {folder.name} {shape} in {time.perf_counter() - started:.0f} s", flush=True)
            table[name] = measure(name, folder, args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    import mlx.core as mx

    print(f"\n{mx.default_device()}, {args.tokens} tokens per stream, median of {args.rounds} rounds per variant")
    print("shapes: " + ", ".join(f"{n} {shapes[n]}" for n in args.shapes) + "\n")
    print("| shape | streams | path | tok/s | vs mlx-lm |")
    print("|---|---|---|---|---|")
    for name, rates in table.items():
        for streams, base in ((1, "mlx_lm.stream_generate"), (8, "mlx_lm batch_generate")):
            for (s, label), rate in rates.items():
                if s == streams:
                    print(f"| {name} | {streams} | {label} | {rate:.1f} | {rate / rates[(streams, base)]:.2f}x |")
    if not args.skip_tests:
        print("\ntests marked gpu:", flush=True)
        # Only the modules marked gpu: collecting the others would import what only the test extra installs. One
        # at a time (`-n 0`): side by side they would share the one device and its memory.
        marked = [str(p) for p in sorted((ROOT / "tests").rglob("test_*.py")) if "mark.gpu" in p.read_text()]
        code = subprocess.call([sys.executable, "-m", "pytest", "-n", "0", "-m", "gpu", "-q", "-x", *marked], cwd=ROOT)
        if code:
            raise SystemExit(code)


if __name__ == "__main__":
    main()
