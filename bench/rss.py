"""Peak RSS per rank: TP=1 against TP=2, and pipeline stages PP=2 and PP=3, on a generated fp32 model.

Run: .venv/bin/python bench/rss.py [--hidden 1024 --layers 12]
Prints a markdown table. Each run is a fresh leader process (MLX allows one
group per process); peak RSS is each process's VmHWM after loading the model
and generating 16 tokens. The floor row is a process that only imported MLX
and mlx-lm, measured in the same run. A rank that loads only its share reads
only its share: its peak is the floor plus its parameters.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # testkit, the leader scenarios the tests run among it


def peak_rss_mb(pid: int | str, field: str = "VmHWM") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


async def _measure(model: str, world_size: int, stages: int) -> dict:
    """In a fresh leader process: load, generate 16 tokens, read every rank's RSS."""
    from neuron.pool import Layout, Pool
    from testkit.leader_scenarios import PROMPT, greedy

    async with Pool(model, Layout.local(world_size, stages)) as pool:
        loaded = await pool.load()
        await greedy(pool, PROMPT, 16)
        pids: list[int | str] = ["self", *(w.pid for w in pool.workers)]
        return {
            "rss": [peak_rss_mb(p) for p in pids],
            "now": [peak_rss_mb(p, "VmRSS") for p in pids],
            "params": [loaded[r].parameters for r in sorted(loaded)],
        }


def _child(*args: str) -> str:
    """Run this script again with ``args`` (one group per process) and return its last stdout line."""
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True, cwd=ROOT)
    return out.stdout.strip().splitlines()[-1]


def run_leader(model: Path, world_size: int, stages: int = 1) -> dict:
    return json.loads(_child("--leader", str(model), str(world_size), str(stages)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--leader", nargs=3, metavar=("MODEL", "RANKS", "STAGES"), help=argparse.SUPPRESS)
    parser.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.leader:
        print(json.dumps(anyio.run(_measure, args.leader[0], int(args.leader[1]), int(args.leader[2]))))
        return
    if args.floor:
        import mlx.core  # noqa: F401
        import mlx_lm.utils  # noqa: F401

        print(peak_rss_mb("self"))
        return
    from testkit import make_tiny_model

    floor = _child("--floor")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "m", "qwen3", hidden=args.hidden, layers=args.layers)
        runs = {
            "TP=1": run_leader(model, 1),
            "TP=2": run_leader(model, 2),
            "PP=2": run_leader(model, 2, 2),
            "PP=3": run_leader(model, 3, 3),
        }
    tp1 = runs["TP=1"]
    weights_mb = tp1["params"][0] * 4 / 2**20
    print(
        f"Model: generated qwen3, hidden {args.hidden}, {args.layers} layers, "
        f"{tp1['params'][0] / 1e6:.1f}M params, fp32 ({weights_mb:.0f} MiB)\n"
    )
    print("| run | rank | params on rank (M) | peak RSS (MiB) | peak vs TP=1 | RSS after 16 tokens (MiB) |")
    print("|---|---|---|---|---|---|")
    print(f"| floor (import mlx) | - | - | {float(floor):.0f} | - | - |")
    base = tp1["rss"][0]
    for name, result in runs.items():
        rows = zip(result["rss"], result["now"], result["params"], strict=True)
        for rank, (rss, now, params) in enumerate(rows):
            print(f"| {name} | {rank} | {params / 1e6:.1f} | {rss:.0f} | {rss / base:.2f}x | {now:.0f} |")


if __name__ == "__main__":
    main()
