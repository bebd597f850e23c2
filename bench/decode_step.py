"""Where a TP=1 decode step's time goes, with the fused projections (neuron/rank/model/fuse.py) and without.

Run: .venv/bin/python bench/decode_step.py [--model FOLDER] [--batch 1 8] [--steps 15] [--rounds 3]
                                           [--blas NAME] [--gemv on|off] [--threads 2] [--variants unfused fused]

The bench re-runs itself in a child with ``--blas`` preloaded as neuron would
(``neuron.system.cpu.preload_for``: with ``--gemv on``, the one-row interposer ahead of
it), ``--threads`` BLAS threads, as neuron's TP=1 leader runs. In that one process every variant's
model is loaded side by side and the variants are timed in alternating rounds
(the order flipped every round), so the ratios against the first variant are
taken under the same noise. Per batch size and variant, medians over the steps:

- neuron: rank 0's ``Rank.step`` with ``Head.step`` (greedy), the serving path;
- raw: mlx-lm's own forward, argmax and eval, on the same model;
- build: raw's Python until the lazy logits come back (the graph built, nothing run);
- eval: raw minus build, the graph run by MLX;
- BLAS: the step's matrix products alone, on the model's own weights, at the step's row count, summed;
- other: eval minus BLAS (MLX's other ops, dispatch, BLAS threads waking);
- floor: the model's weight bytes over the read bandwidth (every weight is read once a step), and the
  share of it the neuron step reaches. The bandwidth is read with numpy by one process per core at once
  (``fastpath.py``'s all-core row): two threads of a BLAS read from both cores, and one core alone reads
  about half of what two do on the 2-core box this was written on.

Variants: ``unfused`` (as loaded, no fusion), ``fused`` (what neuron loads: fuse.GROUPS), ``qkv`` and
``gate_up`` (one group alone).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

    from neuron.rank.rank import Rank

CHILD = "NEURON_DECODE_STEP_CHILD"
BANDWIDTH = "NEURON_DECODE_STEP_GB_S"  # "one core,all cores", measured by the parent before MLX loads anywhere
PROMPT = 32


def _groups(variant: str) -> tuple[tuple[str, ...], ...]:
    from neuron.rank.model import fuse

    return {"unfused": (), "fused": fuse.GROUPS, "qkv": (fuse.QKV,), "gate_up": (fuse.GATE_UP,)}[variant]


def load_rank(model: str, variant: str) -> Rank:
    """A TP=1 rank 0 loaded the way the server loads it, with only ``variant``'s groups fused."""
    from unittest import mock

    from neuron.rank.model import fuse
    from neuron.rank.rank import Rank

    rank = Rank(0, 1)
    with mock.patch("neuron.rank.model.share.fuse_projections", lambda *_: 0):  # load unfused, then fuse what is asked
        rank.load(model, [])
    assert rank.model is not None
    fuse.fuse_projections(rank.model, _groups(variant))
    return rank


def prompt() -> list[int]:
    return [(7 * i + 3) % 200 + 10 for i in range(PROMPT)]


def time_neuron(rank: Rank, batch: int, steps: int) -> float:
    """Median ms of rank 0's step plus greedy sampling, ``batch`` sequences decoding together."""
    from neuron.rank.head.head import Head
    from neuron.rpc import Decode, Prefill, StepPlan
    from neuron.sampling_params import SamplingParams
    from neuron.step import Start, Step

    rank.clear_kv_cache()
    head = Head()
    plan = StepPlan(prefill=[Prefill(s, 0, prompt(), True, [], False) for s in range(batch)])
    greedy = {s: Start(SamplingParams(temperature=0.0)) for s in range(batch)}
    out = head.step(Step(plan, greedy), rank.step(plan) or {})
    tokens = {s: out[s].token for s in range(batch)}
    times = []
    for _ in range(steps):
        plan = StepPlan(decode=[Decode(s, tokens[s], 0, [], 0) for s in range(batch)])
        started = time.perf_counter()
        out = head.step(Step(plan), rank.step(plan) or {})
        times.append(time.perf_counter() - started)
        tokens = {s: out[s].token for s in range(batch)}
    return statistics.median(times) * 1e3


def time_raw(model: nn.Module, batch: int, steps: int) -> tuple[float, float]:
    """Median ms of mlx-lm's own greedy step, and of its graph build alone (until the lazy logits return)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    token = mx.argmax(model(mx.array([prompt()] * batch), cache=cache)[:, -1], axis=-1)
    mx.eval(token)
    totals, builds = [], []
    for _ in range(steps):
        started = time.perf_counter()
        logits = model(token[:, None], cache=cache)
        built = time.perf_counter()
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(token)
        token.tolist()
        totals.append(time.perf_counter() - started)
        builds.append(built - started)
    return statistics.median(totals) * 1e3, statistics.median(builds) * 1e3


def matrices(model: nn.Module) -> list[mx.array]:
    """The weight of every matrix product a step makes, in the model's own arrays: a fused group's one matrix,
    every other linear layer's, and the vocabulary projection (the embedding, where it is tied)."""
    from mlx.nn.layers.distributed import ShardedToAllLinear

    from neuron.rank.model import fuse

    out = []
    for name, module in model.named_modules():
        if "._" in name:  # a fused group's own layers (``_fused``, ``_own``): its lead counts it once
            continue
        if isinstance(module, fuse.FusedLead):
            out.append(module._fused["weight"])
        elif type(module) in (*fuse.PLAIN_LINEAR, ShardedToAllLinear) and module.weight.ndim == 2:
            out.append(module.weight)
    if "lm_head" not in model:
        out.append(model.model.embed_tokens.weight)
    return out


def time_blas(model: nn.Module, batch: int, steps: int) -> float:
    """Median ms of the step's products alone, one eval for all of them, as a step evaluates its graph."""
    import mlx.core as mx

    weights = matrices(model)
    inputs = {w.shape[1]: mx.random.normal((batch, w.shape[1])) for w in weights}
    mx.eval(list(inputs.values()))
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        mx.eval([inputs[w.shape[1]] @ w.T for w in weights])
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def bandwidth() -> tuple[float, float]:
    """GB/s read by one process, and by one process per core at once (summed)."""
    from fastpath import _child, _result, read_bandwidth

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    together = [_child("--bandwidth", env=dict(os.environ)) for _ in range(cores)]
    return read_bandwidth(), sum(_result(p)["gb_s"] for p in together)


def child(args: argparse.Namespace) -> None:
    from mlx.utils import tree_flatten

    from neuron.system import cpu

    ranks = {variant: load_rank(args.model, variant) for variant in args.variants}
    first = ranks[args.variants[0]].model
    assert first is not None
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(first.parameters()))
    one, together = (float(v) for v in os.environ[BANDWIDTH].split(","))
    floor = weight_bytes / together / 1e6
    print(f"model {Path(args.model).name}: {weight_bytes / 1e6:.0f} MB of weights; {cpu.blas_in_use()}, ", end="")
    print(f"{args.threads} threads")
    print(
        f"read bandwidth: one core {one:.1f} GB/s (floor {weight_bytes / one / 1e6:.1f} ms/step), "
        f"all cores {together:.1f} GB/s (floor {floor:.1f} ms/step: the % column)"
    )
    print(f"{args.rounds} alternating rounds of {args.steps} steps; medians of the rounds' medians\n")
    keys = ("neuron", "raw", "build", "blas")
    for batch in args.batch:
        got: dict[str, dict[str, list[float]]] = {v: {k: [] for k in keys} for v in args.variants}
        for round_no in range(args.rounds):
            order = args.variants if round_no % 2 == 0 else args.variants[::-1]
            for variant in order:
                rank = ranks[variant]
                assert rank.model is not None
                into = got[variant]
                into["neuron"].append(time_neuron(rank, batch, args.steps))
                raw, build = time_raw(rank.model, batch, args.steps)
                into["raw"].append(raw)
                into["build"].append(build)
                into["blas"].append(time_blas(rank.model, batch, args.steps))
                rank.clear_kv_cache()
        print(f"batch {batch}")
        print(
            "| variant | neuron ms | vs first | raw ms | build ms | eval ms | BLAS ms | other ms "
            "| ms/token | % of bandwidth | neuron rounds |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        base = statistics.median(got[args.variants[0]]["neuron"])
        for variant in args.variants:
            m = {k: statistics.median(v) for k, v in got[variant].items()}
            evaluated = m["raw"] - m["build"]
            print(
                f"| {variant} | {m['neuron']:.1f} | {m['neuron'] / base:.3f} | {m['raw']:.1f} | {m['build']:.1f} "
                f"| {evaluated:.1f} | {m['blas']:.1f} | {evaluated - m['blas']:.1f} | {m['neuron'] / batch:.1f} "
                f"| {floor / m['neuron']:.0%} | {' '.join(f'{v:.1f}' for v in got[variant]['neuron'])} |"
            )
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: the embedded SmolLM2, fp32)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blas", help="as NEURON_BLAS: openblas, blis, reference or a path (default: neuron's pick)")
    parser.add_argument("--gemv", choices=["on", "off"], default="on", help="one-row products by sgemv (neuron's)")
    parser.add_argument("--threads", type=int, default=2, help="BLAS threads (neuron's TP=1 leader: all cores)")
    parser.add_argument(
        "--variants", nargs="+", default=["unfused", "fused"], choices=["unfused", "fused", "qkv", "gate_up"]
    )
    args = parser.parse_args()
    if os.environ.get(CHILD):
        child(args)
        return

    from neuron.models.folder import resolve
    from neuron.system import cpu

    args.model = str(resolve(args.model))
    env = {k: v for k, v in os.environ.items() if k != cpu.PRELOAD_ENV}
    os.environ[cpu.BLAS_ENV] = args.blas or os.environ.get(cpu.BLAS_ENV, "")
    os.environ[cpu.GEMV_ENV] = args.gemv
    library = cpu.find_blas()
    one, together = bandwidth()
    env.update({CHILD: "1", cpu.REEXEC_GUARD: "1", BANDWIDTH: f"{one},{together}"})
    for threads in ("OPENBLAS_NUM_THREADS", "BLIS_NUM_THREADS", "OMP_NUM_THREADS"):
        env[threads] = str(args.threads)
    if library:
        env[cpu.PRELOAD_ENV] = ":".join(cpu.preload_for(library)[0])
    forwarded = sys.argv[1:]
    if "--model" not in forwarded:
        forwarded += ["--model", args.model]
    sys.exit(subprocess.run([sys.executable, __file__, *forwarded], env=env, cwd=ROOT).returncode)


if __name__ == "__main__":
    main()
