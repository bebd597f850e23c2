"""Which BLAS serves neuron best on this CPU: every installed library, end to end through ``neuron serve``, one run.

Run: .venv/bin/python bench/blas.py [--model FOLDER_OR_GGUF] [--tp 1] [--rounds 2] [--libraries reference openblas blis]

For each library (``NEURON_BLAS``), a ``neuron serve`` of its own, as neuron
runs it (one-row products by ``cblas_sgemv``, through ``neuron/system/native/gemv.c``)
and with every product on the library's sgemm (``NEURON_GEMV=off``), with
speculation off so that decode is plain; the servers take turns, round after
round, so that the machine's noise hits them alike. Each measures, greedy:

- TTFT: a ``--prompt``-token completion with one token out (prefill, the projection, the first sample), median;
- decode: one streamed request of ``--tokens`` tokens, (tokens - 1) / (first to last token), median;
- 8 streams: eight such requests at once, completion tokens over the wall time of the batch.

The ratios are against OpenBLAS with sgemm only (the default before this
bench), measured in the same run. The reference BLAS runs one round only: it takes minutes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from streaming import stream_completion  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
STORY = "Once upon a time, in a small village by the sea, there lived"


def long_prompt(tokens: int) -> str:
    """About ``tokens`` tokens of varied words (SmolLM2's tokenizer: one token a word, give or take)."""
    return " ".join(WORDS[(i * 7 + i // len(WORDS)) % len(WORDS)] for i in range(tokens))


def measure(url: str, model: str, prompt: int, tokens: int, repeats: int) -> dict[str, float]:
    ttft = []
    for i in range(repeats):
        streamed = stream_completion(url, model, f"{i} {long_prompt(prompt)}", 1)  # a new prompt: no prefix hit
        ttft.append(streamed.text_at[0] - streamed.started)
    decode = []
    for _ in range(repeats):
        streamed = stream_completion(url, model, STORY, tokens)
        decode.append((streamed.tokens - 1) / (streamed.text_at[-1] - streamed.text_at[0]))
    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda i: stream_completion(url, model, f"{STORY} {WORDS[i]}", tokens), range(8)))
    aggregate = sum(s.tokens for s in done) / (time.perf_counter() - started)
    return {"ttft": statistics.median(ttft), "decode": statistics.median(decode), "eight": aggregate}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="model folder or GGUF (default: the embedded SmolLM2, in fp32)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="TTFT and decode requests per round")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens for TTFT")
    parser.add_argument("--tokens", type=int, default=48, help="completion tokens per decode request")
    parser.add_argument("--libraries", nargs="+", default=["reference", "openblas", "blis"])
    args = parser.parse_args()

    from neuron.models.folder import model_id
    from neuron.system import cpu
    from testkit import Server

    by_name = {library.name.lower(): library for library in cpu.LIBRARIES}
    libraries = [n for n in args.libraries if n == "reference" or cpu.installed(by_name[n]) is not None]
    skipped = sorted(set(args.libraries) - set(libraries))
    configs = {}  # label -> the server's environment
    for name in libraries:
        configs[name] = {cpu.BLAS_ENV: name}
        if name != "reference":
            configs[f"{name}, sgemm only"] = {cpu.BLAS_ENV: name, cpu.GEMV_ENV: "off"}
    model = model_id(args.model)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    paths: dict[str, str] = {}
    for round_no in range(args.rounds):
        for name, env in configs.items():
            if name == "reference" and round_no:
                continue
            log = Path(os.environ.get("TMPDIR", "/tmp")) / f"neuron-bench-blas-{os.getpid()}-{len(paths)}.log"
            extra = ["--model", args.model] if args.model else []
            server = Server(*extra, "--tp", str(args.tp), "--speculate", "off", log_path=log, env=env)
            try:
                server.start()
                paths[name] = server.find_log("starting")["blas"]
                stream_completion(server.url, model, "Hello", 4)  # warm-up
                results[name].append(measure(server.url, model, args.prompt, args.tokens, args.repeats))
                print(f"round {round_no + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
            finally:
                server.stop()

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    base = "openblas, sgemm only" if "openblas" in libraries else next(iter(configs))
    print(f"\nmodel {model}, TP={args.tp}, {args.prompt}-token prompt, {args.tokens} tokens out, {args.rounds} rounds")
    if skipped:
        print(f"not installed, skipped: {', '.join(skipped)}")
    print("\n| BLAS | TTFT s | vs | decode tok/s | vs | 8 streams tok/s | vs | library |")
    print("|---|---|---|---|---|---|---|---|")
    for name in configs:
        ttft, decode, eight = (median(name, k) for k in ("ttft", "decode", "eight"))
        print(
            f"| {name} | {ttft:.2f} | {median(base, 'ttft') / ttft:.2f}x | {decode:.1f} | "
            f"{decode / median(base, 'decode'):.2f}x | {eight:.1f} | {eight / median(base, 'eight'):.2f}x | "
            f"{paths[name]} |"
        )


if __name__ == "__main__":
    main()
