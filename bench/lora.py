"""What LoRA adapters cost a TP=1 decode step (neuron/rank/model/lora.py), against the same model with none loaded.

Run: .venv/bin/python bench/lora.py [--model FOLDER] [--batch 8] [--rank 8] [--steps 10] [--rounds 3]

The bench re-runs itself with the BLAS neuron picks preloaded (``neuron.system.cpu.preload_for``), as the leader does.
Two ranks 0 in one process, loaded as the server loads them: one with no adapter, one with two random adapters
(mlx-lm's format, ``--rank``, on every projection of every layer, as ``mlx_lm.lora`` makes them with all its
keys). Each decodes ``--batch`` rows together, greedy, step after step; the variants are timed in alternating
rounds (the order flipped every round), medians of a step's milliseconds, and the ratios are against the rank
with no adapter, measured in the same run:

- none: no adapter loaded (the baseline);
- base rows: adapters loaded, every row the base model's (each adapted projection checks and goes on);
- one adapter: every row adapter A's (one more pair of small products per projection);
- two adapters: half the rows A's, half B's (two pairs, each over the whole batch, masked to its rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neuron.rpc import Decode, Prefill, StepPlan  # noqa: E402
from neuron.sampling_params import SamplingParams  # noqa: E402
from neuron.step import Start, Step  # noqa: E402
from neuron.system import cpu  # noqa: E402

if TYPE_CHECKING:
    from neuron.rank.rank import Rank

KEYS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
PROMPT = [(7 * i + 3) % 200 + 10 for i in range(32)]


def decode_ms(rank: Rank, adapters: list[int], steps: int) -> float:
    """Median ms of a decode step (rank 0's step and greedy sampling) of one row per entry of ``adapters``."""
    from neuron.rank.head.head import Head
    from neuron.rank.rank import run

    head = Head()
    rank.clear_kv_cache()
    rows = range(1, len(adapters) + 1)
    prefill = [Prefill(seq, 0, PROMPT, True, adapter=adapters[seq - 1]) for seq in rows]
    starts = {seq: Start(SamplingParams()) for seq in rows}
    step = Step(StepPlan(prefill=prefill), starts)
    tokens = {no: s.token for no, s in run(rank, step, head).sampled.items()}
    times = []
    for _ in range(steps):
        plan = StepPlan(decode=[Decode(seq, tokens[seq], 0, adapter=adapters[seq - 1]) for seq in rows])
        started = time.perf_counter()
        tokens = {no: s.token for no, s in run(rank, Step(plan), head).sampled.items()}
        times.append((time.perf_counter() - started) * 1000)
    head.clear()
    return statistics.median(times)


def with_blas() -> None:
    """Run again with neuron's BLAS preloaded, once (MLX must not be loaded yet)."""
    library = cpu.find_blas() if cpu.is_linux_cpu_backend() else None
    if library is None or os.environ.get(cpu.REEXEC_GUARD):
        return
    env = {**os.environ, cpu.REEXEC_GUARD: "1", cpu.PRELOAD_ENV: ":".join(cpu.preload_for(library)[0])}
    os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)


def main() -> None:
    with_blas()
    from neuron.models.folder import resolve, text_config
    from neuron.rank.rank import Rank
    from testkit import make_tiny_model
    from testkit.adapters import make_adapter

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=None, help="a model folder (default: a random llama of SmolLM2-135M's width, 8 layers, fp32)"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="neuron-bench-lora-"))
    # The embedded SmolLM2 is quantized (Q4_1), whose CPU products dwarf everything else in a step.
    model = resolve(args.model) if args.model else make_tiny_model(scratch / "base", "llama", hidden=576, layers=8)
    layers = int(text_config(json.loads((model / "config.json").read_text()))["num_hidden_layers"])
    paths = [make_adapter(model, scratch / n, seed, args.rank, 2.0, layers, KEYS) for seed, n in ((1, "a"), (2, "b"))]
    plain, adapted = Rank(0, 1), Rank(0, 1)
    plain.load(str(model), [])
    adapted.load(str(model), [])
    for number, path in enumerate(paths, start=1):
        adapted.load_adapter(number, path.name, str(path))
    half = args.batch // 2
    variants = {
        "none": (plain, [0] * args.batch),
        "base rows": (adapted, [0] * args.batch),
        "one adapter": (adapted, [1] * args.batch),
        "two adapters": (adapted, [1] * half + [2] * (args.batch - half)),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            rank, rows = variants[name]
            samples[name].append(decode_ms(rank, rows, args.steps))
    baseline = statistics.median(samples["none"])
    print(f"{model.name}, batch {args.batch}, LoRA rank {args.rank} on {len(KEYS)} projections x {layers} layers")
    print(f"  BLAS: {cpu.blas_in_use()}")
    for name, values in samples.items():
        ms = statistics.median(values)
        print(f"  {name:13s} {ms:8.2f} ms/step  x{ms / baseline:.2f}")


if __name__ == "__main__":
    main()
