"""TP overhead: neuron's step against a bare mx.distributed decode loop, and the pipe round trip alone.

Run: .venv/bin/python bench/tp_overhead.py [--hidden 2048 --layers 8 --intermediate 5888] [--vocab 32000] [--tokens 32]

On one generated fp32 Qwen3 (default about 390M parameters), in the same run:

- bare TP=1 loops, one and two BLAS threads: mlx-lm's model and KV cache,
  greedy, nothing else (the floor a single process reaches);
- bare TP=2 loops over the ring backend: two processes, mlx-lm's ``shard()``,
  no pipes, every rank taking the argmax itself (the logits are identical);
  floating or pinned to a core each, with one or two BLAS threads per rank; then
  pinned with one thread (what neuron's leader sets up) with rank 1 skipping the
  LM head, and with the LM head held as neuron holds it (split over the ranks
  when it is big enough): the work neuron does, the baseline of the ratio;
- neuron's pool at TP=1 and TP=2: ``Pool.step`` per token, plan, pipes, drain and
  fingerprint included;
- the pipe round trip alone, no MLX work: a ping line to the worker and its
  reply, and ``Pool.ping``, the same through the fan-out and drain of a step.

Every figure is the median per-token decode time over ``--tokens`` steps, after a
16-token prompt. OpenBLAS is preloaded in every process when present.
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

PROMPT = list(range(5, 21))


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    from neuron.system import cpu

    env = {**os.environ, **(extra or {})}
    if cpu.is_linux_cpu_backend() and (library := cpu.find_blas()):
        env[cpu.PRELOAD_ENV] = library
        env[cpu.REEXEC_GUARD] = "1"
    return env


def bare(model: str, tokens: int, blas_threads: int, cpus: list[int] | None) -> dict[str, float]:
    """One rank of a bare loop (TP=1 when MLX_RANK is unset); rank 0 prints the median ms per token.

    Every rank takes the argmax itself (the logits are identical). BENCH_HEAD=rank0:
    rank 1 stops before the LM head and feeds a fixed token (the cost is the
    same); BENCH_HEAD=split: the head is split over the ranks where neuron splits it
    (``slice_head``: big enough heads only), else as without it.
    """
    from neuron.system import cpu

    if cpus is not None:
        cpu.pin(cpus)
    cpu.set_blas_threads(blas_threads)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    loaded, _ = load_model(Path(model), lazy=True)
    if "MLX_RANK" in os.environ:
        loaded.shard(mx.distributed.init(backend="ring", strict=True))
    mx.eval(loaded.parameters())
    cache = make_prompt_cache(loaded)
    from neuron.rank.model.parts import backbone
    from neuron.rank.model.share import slice_head

    mode = os.environ.get("BENCH_HEAD", "")
    head = slice_head(loaded, "qwen3", mx.distributed.init()) if mode == "split" else None
    if head is not None:
        trunk = backbone(loaded)

        def forward(ids: mx.array) -> mx.array:
            token = mx.argmax(head(trunk(ids, cache=cache)[:, -1, :])[0])
            mx.eval(token)
            return token
    elif mode == "rank0" and os.environ.get("MLX_RANK") == "1":
        inner = backbone(loaded)

        def forward(ids: mx.array) -> mx.array:
            mx.eval(inner(ids, cache=cache))
            return mx.array(5)
    else:

        def forward(ids: mx.array) -> mx.array:
            token = mx.argmax(loaded(ids, cache=cache)[0, -1])
            mx.eval(token)
            return token

    token = forward(mx.array([PROMPT]))
    times = []
    for _ in range(tokens):
        started = time.perf_counter()
        token = forward(token.reshape(1, 1))
        times.append(time.perf_counter() - started)
    return {"ms": statistics.median(times) * 1000}


async def pooled(model: str, world_size: int, tokens: int) -> dict[str, float]:
    """neuron's pool: one ``Pool.step`` per token, and ``Pool.ping`` round trips."""
    from neuron.pool import Layout, Pool
    from testkit.leader_scenarios import greedy_timed  # the leader scenarios the tests run

    async with Pool(model, Layout.local(world_size)) as pool:
        await pool.load()
        step_s = await greedy_timed(pool, PROMPT, tokens)
        from neuron import rpc

        pings, pipe = [], []
        for _ in range(1000):
            started = time.perf_counter()
            await pool.ping()
            pings.append(time.perf_counter() - started)
            for worker in pool.workers:
                started = time.perf_counter()
                await worker.receive(await worker.send(rpc.Ping(id=worker.take_id()), 10), 10)
                pipe.append(time.perf_counter() - started)
    out = {"ms": statistics.median(step_s) * 1000, "ping_us": statistics.median(pings) * 1e6}
    return out | ({"pipe_us": statistics.median(pipe) * 1e6} if pipe else {})


def _child(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=_env(env), cwd=ROOT
    )


def _result(process: subprocess.Popen[str]) -> dict[str, float]:
    out, _ = process.communicate(timeout=900)
    if process.returncode != 0:
        raise RuntimeError(f"{process.args} exited {process.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def bare_ring(model: Path, tokens: int, scratch: Path, pinned: bool, blas: int, head: str = "") -> dict[str, float]:
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hostfile = scratch / "hostfile.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    ranks = [
        _child(
            "--bare",
            str(model),
            str(tokens),
            str(blas),
            str(rank) if pinned else "-",
            env={"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "BENCH_HEAD": head},
        )
        for rank in range(2)
    ]
    rank0, _ = (_result(r) for r in ranks)  # both must finish
    return rank0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_flags(parser)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", help="an existing model folder instead of a generated one")
    parser.add_argument("--bare", nargs=4, metavar=("MODEL", "TOKENS", "BLAS", "CPU"), help=argparse.SUPPRESS)
    parser.add_argument("--pool", nargs=3, metavar=("MODEL", "TP", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        model, tokens, blas, core = args.bare
        cpus = None if core == "-" else [int(core)]
        print(json.dumps(bare(model, int(tokens), int(blas), cpus)))
        return
    if args.pool:
        import anyio

        model, tp, tokens = args.pool
        print(json.dumps(anyio.run(pooled, model, int(tp), int(tokens))))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else generated_model(args, Path(tmp) / "qwen3")
        params = sum(
            v.size for v in __import__("mlx.core", fromlist=["load"]).load(str(model / "model.safetensors")).values()
        )
        rows: list[tuple[str, dict[str, float]]] = []
        tokens = str(args.tokens)
        rows.append(("bare TP=1, 1 BLAS thread", _result(_child("--bare", str(model), tokens, "1", "-"))))
        rows.append(("bare TP=1, 2 BLAS threads", _result(_child("--bare", str(model), tokens, "2", "-"))))
        for pinned, blas in ((False, 2), (False, 1), (True, 2), (True, 1)):
            how = f"{'pinned' if pinned else 'unpinned'}, {blas} BLAS thread{'s' if blas > 1 else ''} per rank"
            rows.append((f"bare TP=2, ring, {how}", bare_ring(model, args.tokens, Path(tmp), pinned, blas)))
        for head, how in (("rank0", "rank 1 skips the LM head"), ("split", "LM head held as neuron holds it")):
            name = f"bare TP=2, ring, pinned, 1 BLAS thread per rank, {how}"
            rows.append((name, bare_ring(model, args.tokens, Path(tmp), True, 1, head)))
        rows.append(("neuron TP=1 (Pool.step)", _result(_child("--pool", str(model), "1", tokens))))
        rows.append(("neuron TP=2 (Pool.step)", _result(_child("--pool", str(model), "2", tokens))))

    best_tp1 = min(r["ms"] for name, r in rows if "TP=1" in name)
    ring = rows[7][1]["ms"]  # pinned, one BLAS thread per rank, the head as neuron holds it: neuron's work
    print(f"model: generated qwen3, {params / 1e6:.0f}M parameters fp32, {args.tokens} decode steps\n")
    print("| loop | ms/token (median) | vs best TP=1 | vs bare TP=2 as neuron splits it |")
    print("|---|---|---|---|")
    for name, result in rows:
        ms = result["ms"]
        print(f"| {name} | {ms:.1f} | {ms / best_tp1:.2f}x | {ms / ring:.2f}x |")
    pool = rows[-1][1]
    print(f"\npipe round trip to the worker, p50: {pool['pipe_us']:.0f} us (one request line out, its reply back)")
    print(f"Pool.ping, p50: {pool['ping_us']:.0f} us (the same, through the fan-out and drain every step uses)")


if __name__ == "__main__":
    main()
