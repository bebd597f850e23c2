"""Pipeline stages against tensor parallelism and one rank: decode at 1 and 8 streams, in one run.

Run: .venv/bin/python bench/pipeline.py [--rounds 2] [--tokens 32] [--hosts]

On a generated fp32 Qwen3 (default about 390M parameters), each configuration
in a fresh leader process running neuron's engine (what ``neuron generate``
runs): TP=1 on both cores; TP=2 and PP=2 with a rank per core; PP=2 with one
decode pass per step (``--micro-batches 1``) and with two (the default), so
that stage 1 works on one half of the batch while rank 0 works on the other.
With ``--hosts`` (root, sshd), the two-rank setups also run across two hosts
made of network namespaces (testkit/testbed.py). Rounds alternate; figures are
medians.

Decode rate: completion tokens after each stream's first, over the time from
the first stream's first token to the last stream's last (prefill excluded).
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
from pathlib import Path

from generated import ROOT, add_shape_flags, generated_model

PROMPTS = [f"Stream {i}: the quick brown fox jumps over the lazy dog" for i in range(8)]


def engine_run(model: str, hostfile: str, ssh: str, stages: int, micro: int, streams: int, tokens: int) -> dict:
    """In a fresh leader process: ``streams`` greedy generations at once; the aggregate decode rate."""
    import anyio

    from neuron.engine.engine import Engine
    from neuron.engine.scheduler import Scheduling
    from neuron.engine.sequence import Chunk
    from neuron.launch.hosts import read_hostfile
    from neuron.launch.launcher import Launcher
    from neuron.pool import Layout
    from neuron.sampling_params import SamplingParams

    async def run() -> dict:
        layout = Layout(Launcher(read_hostfile(hostfile), ssh), "ring", stages)
        limits = Scheduling(micro_batches=micro, prefix_cache_bytes=0)  # as first measured: every prompt fed whole
        async with Engine.open(Path(model), layout, limits=limits, model=model) as engine:
            stamps: list[list[float]] = []

            async def one(prompt: str) -> None:
                seq = engine.submit(engine.text.encode(prompt), SamplingParams(max_tokens=tokens, stop=()))
                mine = []
                async for event in seq.events:
                    if isinstance(event, Chunk):
                        mine.append(time.perf_counter())
                stamps.append(mine)

            async with anyio.create_task_group() as tg:
                for prompt in PROMPTS[:streams]:
                    tg.start_soon(one, prompt)
        first, last = min(s[0] for s in stamps), max(s[-1] for s in stamps)
        return {"tok_s": sum(len(s) - 1 for s in stamps) / (last - first)}

    return anyio.run(run)


def _result(args: list[str], env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{args} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_flags(parser)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hosts", action="store_true", help="also across two namespace hosts (root, sshd)")
    parser.add_argument("--run", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        model, hostfile, ssh, stages, micro, streams, tokens = args.run
        print(json.dumps(engine_run(model, hostfile, ssh, int(stages), int(micro), int(streams), int(tokens))))
        return

    from neuron.system import cpu

    env = dict(os.environ)
    if cpu.is_linux_cpu_backend() and (library := cpu.find_blas()):
        env[cpu.PRELOAD_ENV], env[cpu.REEXEC_GUARD] = library, "1"
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = generated_model(args, scratch / "qwen3")
        one = scratch / "one.json"
        one.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}]))
        two = scratch / "two.json"
        two.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"], "cpus": [c]} for c in (0, 1)]))
        setups = {
            "TP=1": (one, 1, 1),
            "TP=2": (two, 1, 1),
            "PP=2, 1 pass per step": (two, 2, 1),
            "PP=2, 2 micro-batches": (two, 2, 2),
        }
        bed = None
        if args.hosts:
            from testkit.testbed import Namespaces

            (scratch / "bed").mkdir()
            bed = Namespaces(1, scratch / "bed").start()
            across = bed.hostfile([bed.entry(-1, cpus=[0]), bed.entry(0, cpus=[1])], "across.json")
            setups |= {
                "TP=2 across hosts": (across, 1, 1),
                "PP=2 across hosts, 1 pass per step": (across, 2, 1),
                "PP=2 across hosts, 2 micro-batches": (across, 2, 2),
            }
        ssh = bed.ssh_command if bed else "ssh"
        rates: dict[tuple[str, int], list[float]] = {}
        try:
            for _ in range(args.rounds):
                for name, (hostfile, stages, micro) in setups.items():
                    for streams in (1, 8):
                        run = ["--run", str(model), str(hostfile), ssh, str(stages), str(micro), str(streams)]
                        result = _result([*run, str(args.tokens)], env)
                        rates.setdefault((name, streams), []).append(result["tok_s"])
        finally:
            if bed:
                bed.close()
    print(f"model: generated qwen3, hidden {args.hidden}, {args.layers} layers, fp32; {args.tokens} tokens per stream")
    print(f"median of {args.rounds} alternating rounds\n")
    print("| setup | 1 stream tok/s | vs TP=1 | 8 streams tok/s | vs TP=1 |")
    print("|---|---|---|---|---|")
    base = {n: statistics.median(rates[("TP=1", n)]) for n in (1, 8)}
    for name in setups:
        one_rate, eight = (statistics.median(rates[(name, n)]) for n in (1, 8))
        print(f"| {name} | {one_rate:.1f} | {one_rate / base[1]:.2f}x | {eight:.1f} | {eight / base[8]:.2f}x |")


if __name__ == "__main__":
    main()
