"""What constrained decoding costs per step: decode steps with JSON-schema masks against free decoding, at batch 1
and 8 (and 8 with half constrained), plus rank 0's sampling alone, on the same model in the same run.

Run: .venv/bin/python bench/grammar.py [--model FOLDER] [--tokens 32] [--rounds 3]

The engine runs in a child process of this script (neuron's engine at TP=1, what ``neuron generate`` runs,
with OpenBLAS preloaded when present). Each round runs every case once, in reverse order every other round,
so that the machine's noise hits them alike; a case's figure is the median over rounds of the mean time per
decode step (first to last token of each sequence, prefill excluded). A case's sequences are compiled first
and submitted together, so they join in one step. The constrained rows follow a schema that cannot close
before ``--tokens`` (an array of at least 200 digits), so every row decodes the same number of steps.
"Sampling only" times ``sample_all`` on random logits of the model's vocabulary, without the model.
Prints a markdown table; trust the ratios, not the absolute times.
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
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 200}
PROMPT = "List two hundred digits, as a JSON array."
CASES = [("batch 1", 1, 0), ("batch 1", 1, 1), ("batch 8", 8, 0), ("batch 8", 8, 4), ("batch 8", 8, 8)]


def child(model: str, tokens: int, rounds: int) -> None:
    import anyio

    sys.path.insert(0, str(ROOT))
    from neuron.engine.engine import Engine
    from neuron.engine.scheduler import Scheduling
    from neuron.engine.sequence import Chunk, Sequence
    from neuron.models.folder import resolve
    from neuron.sampling_params import SamplingParams

    async def steps(seq: Sequence) -> float:
        stamps = [time.perf_counter() async for event in seq.events if isinstance(event, Chunk)]
        assert len(stamps) == tokens, len(stamps)
        return (stamps[-1] - stamps[0]) / (tokens - 1)

    async def case(engine: Engine, prompt: list[int], batch: int, constrained: int) -> float:
        # Compiled first, then all submitted at once: the batch joins in one step, as in the free case.
        params = [
            SamplingParams(max_tokens=tokens, constraint=engine.grammars.compile(SCHEMA) if i < constrained else None)
            for i in range(batch)
        ]
        seqs = [engine.submit(prompt, p) for p in params]
        times: list[float] = []

        async def run(seq: Sequence) -> None:
            times.append(await steps(seq))

        async with anyio.create_task_group() as tg:
            for seq in seqs:
                tg.start_soon(run, seq)
        return statistics.mean(times)

    async def main() -> None:
        # No prefix cache, as these figures were first measured: each case feeds its prompt whole.
        async with Engine.open(resolve(model), limits=Scheduling(prefix_cache_bytes=0)) as engine:
            prompt = engine.text.encode_chat([{"role": "user", "content": PROMPT}])
            await case(engine, prompt, 1, 1)  # warm up
            times: dict[int, list[float]] = {i: [] for i in range(len(CASES))}
            for r in range(rounds):
                order = list(enumerate(CASES))
                for i, (_, batch, constrained) in order if r % 2 == 0 else order[::-1]:
                    times[i].append(await case(engine, prompt, batch, constrained))
            sampling = sampling_only(engine, rounds)
        print(json.dumps({"steps": [statistics.median(t) for t in times.values()], "sampling": sampling}))

    anyio.run(main)


def sampling_only(engine: object, rounds: int) -> dict[str, float]:
    """``sample_all`` per step on random logits: 8 free rows, 8 constrained rows, 1 constrained row."""
    import mlx.core as mx

    from neuron.rank.head.sampler import Sampler, sample_all
    from neuron.sampling_params import SamplingParams

    vocab = engine.vocab_size  # type: ignore[attr-defined]
    out: dict[str, list[float]] = {"free 8": [], "json 8": [], "free 1": [], "json 1": []}
    for _ in range(rounds):
        for name in out:
            rows = int(name.split()[1])
            params = [
                SamplingParams(constraint=engine.grammars.compile(SCHEMA) if name.startswith("json") else None)  # type: ignore[attr-defined]
                for _ in range(rows)
            ]
            samplers = {i: Sampler(p) for i, p in enumerate(params)}
            logits = {i: mx.random.normal((vocab,)) for i in range(rows)}
            mx.eval(list(logits.values()))
            started = time.perf_counter()
            for _ in range(100):
                sample_all(samplers, logits)
            out[name].append((time.perf_counter() - started) / 100)
    return {name: statistics.median(t) for name, t in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "TOKENS", "ROUNDS"), help=argparse.SUPPRESS)
    parser.add_argument("--model", default="", help="model folder or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.child:
        child(args.child[0] or None, int(args.child[1]), int(args.child[2]))  # type: ignore[arg-type]
        return
    sys.path.insert(0, str(ROOT))
    from neuron.system import cpu

    env = dict(os.environ)
    if cpu.is_linux_cpu_backend() and (lib := cpu.find_blas()):
        env["LD_PRELOAD"] = str(lib)
    command = [sys.executable, __file__, "--child", args.model, str(args.tokens), str(args.rounds)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    steps, sampling = result["steps"], result["sampling"]
    print(f"model {args.model or 'SmolLM2-135M-Instruct'}, {args.tokens} tokens per sequence, {args.rounds} rounds\n")
    print("| batch | constrained rows | ms per decode step | against free at that batch |")
    print("|---|---|---|---|")
    free = {1: steps[0], 8: steps[2]}
    for (name, batch, constrained), ms in zip(CASES, steps, strict=True):
        print(f"| {name} | {constrained} | {ms * 1e3:.1f} | {ms / free[batch]:.3f}x |")
    print("\n| rank 0's sampling alone | ms per step | against free |")
    print("|---|---|---|")
    for name, seconds in sampling.items():
        base = sampling["free " + name.split()[1]]
        print(f"| {name} rows | {seconds * 1e3:.3f} | {seconds / base:.2f}x |")


if __name__ == "__main__":
    main()
