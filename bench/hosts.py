"""Ranks on other hosts: a TP=2 step across two network namespaces, against TP=2 on loopback and TP=1, in one run.

Run (as root, with openssh-server and iproute2): .venv/bin/python bench/hosts.py [--rounds 3] [--tokens 32]
[--planes]. With ``--planes``: only TP=2 across the two hosts, the ring's link plain (``--data-plane direct``)
against tunnelled through SSH (``--data-plane ssh``), at one stream and at eight.

The hosts are testkit/testbed.py's: namespaces on a bridge, each with its own sshd,
so the worker is started over SSH and the ring crosses a veth link. All of them
share this machine's cores: rank 0 is pinned to core 0 and rank 1 to core 1 in
both TP=2 setups (the hostfile's ``cpus``), one BLAS thread each, as neuron pins
two local ranks; TP=1 has both cores and two BLAS threads. What differs between
the two TP=2 rows is only the path: a veth and a bridge, and the worker's
process started by sshd, against loopback.

Each configuration runs in a fresh leader process (one group per process),
rounds alternating, and reports the median per decode step of each part, as
the pool times it: fan-out (writing the plan to the worker), rank 0's part (its
forward and sampling, its share of every collective included), drain (after
rank 0's result until the worker's reply). ``collectives`` is measured apart,
with the same processes' setup: a bare loop of 1 x hidden fp32 all_sums across
the same link, times the all-reduces a step makes (two per layer) plus the
split head's all_gather when the head is split.

The link has no emulated latency (this kernel has no ``netem``): the figures are
a veth's, a floor for Ethernet (add its RTT, ~0.05-0.2 ms, per collective) and
close to Thunderbolt's.
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
from typing import TYPE_CHECKING

from generated import ROOT, add_shape_flags, generated_model

if TYPE_CHECKING:
    from testkit.testbed import Namespaces

PROMPT = list(range(5, 21))


def pooled(
    model: str, hostfile: str, ssh_command: str, tokens: int, data_plane: str = "direct", batch: int = 1
) -> dict[str, float]:
    """In a fresh leader: greedy decode ``tokens`` steps of ``batch`` sequences through ``Pool.step``; the median
    of each part, in ms."""
    import anyio

    from neuron.launch.hosts import read_hostfile
    from neuron.launch.launcher import Launcher
    from neuron.pool import Layout, Pool
    from neuron.rpc import Decode, Prefill, StepPlan
    from neuron.sampling_params import SamplingParams
    from neuron.step import Start, Step

    async def run() -> dict[str, float]:
        launcher = Launcher(read_hostfile(hostfile), ssh_command, data_plane)
        async with Pool(model, Layout(launcher), model=model) as pool:
            await pool.load()
            seqs = range(1, batch + 1)
            prompts = [Prefill(seq, 0, PROMPT[seq % 4 :], True) for seq in seqs]  # rows differ a little
            sampled = await pool.step(Step(StepPlan(prefill=prompts), {seq: Start(SamplingParams()) for seq in seqs}))
            last = {seq: sampled[seq].token for seq in seqs}
            parts: dict[str, list[float]] = {"total": [], "fan_out": [], "rank0": [], "drain": []}
            for _ in range(tokens):
                sampled = await pool.step(Step(StepPlan(decode=[Decode(seq, last[seq], 0) for seq in seqs])))
                last = {seq: sampled[seq].token for seq in seqs}
                timing = pool._ranks.fan_out.timing
                for name in parts:
                    parts[name].append(getattr(timing, name))
            return {name: statistics.median(values) * 1000 for name, values in parts.items()}

    return anyio.run(run)


def bare_all_sum(hidden: int, count: int) -> dict[str, float]:
    """One rank of a bare all_sum loop (MLX_RANK and MLX_HOSTFILE set); rank 0 prints the median ms per op."""
    import mlx.core as mx

    group = mx.distributed.init(backend="ring", strict=True)
    x = mx.ones((1, hidden))
    for _ in range(20):
        mx.eval(mx.distributed.all_sum(x, group=group))
    times = []
    for _ in range(count):
        started = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - started)
    return {"ms": statistics.median(times) * 1000}


def _child(*args: str, namespace: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    from neuron.system import cpu

    full = {**os.environ, **(env or {})}
    if cpu.is_linux_cpu_backend() and (library := cpu.find_blas()):
        full[cpu.PRELOAD_ENV] = library
        full[cpu.REEXEC_GUARD] = "1"
    command = [sys.executable, __file__, *args]
    if namespace:
        command = ["ip", "netns", "exec", namespace, *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=full, cwd=ROOT)


def _result(process: subprocess.Popen[str]) -> dict[str, float]:
    out, _ = process.communicate(timeout=900)
    if process.returncode != 0:
        raise RuntimeError(f"{process.args} exited {process.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def collective_ms(ips: list[str], namespaces: list[str | None], hidden: int, scratch: Path) -> float:
    """Median ms of one 1 x hidden all_sum between two processes on ``ips``, each pinned to its own core."""
    import socket

    ports = []
    for ip, ns in zip(ips, namespaces, strict=True):
        if ns is None:
            with socket.socket() as s:
                s.bind((ip, 0))
                ports.append(s.getsockname()[1])
        else:
            ports.append(40000 + os.getpid() % 10000)  # the namespace holds nothing else: any port is free
    hostfile = scratch / f"allsum-{ips[1]}.json"
    hostfile.write_text(json.dumps([[f"{ip}:{port}"] for ip, port in zip(ips, ports, strict=True)]))
    ranks = [
        _child(
            "--all-sum",
            str(hidden),
            str(rank),
            namespace=ns,
            env={"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "OPENBLAS_NUM_THREADS": "1"},
        )
        for rank, ns in enumerate(namespaces)
    ]
    rank0, _ = (_result(r) for r in ranks)
    return rank0["ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_flags(parser)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--planes", action="store_true", help="only TP=2 across the two hosts, --data-plane direct against ssh"
    )
    parser.add_argument("--pool", nargs=6, help=argparse.SUPPRESS)  # MODEL HOSTFILE SSH TOKENS PLANE BATCH
    parser.add_argument("--all-sum", nargs=2, metavar=("HIDDEN", "CORE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pool:
        model, hostfile, ssh, tokens, plane, batch = args.pool
        print(json.dumps(pooled(model, hostfile, ssh, int(tokens), plane, int(batch))))
        return
    if args.all_sum:
        from neuron.system import cpu

        cpu.pin([int(args.all_sum[1])])
        print(json.dumps(bare_all_sum(int(args.all_sum[0]), 500)))
        return

    from testkit.testbed import unavailable

    if reason := unavailable():
        sys.exit(f"bench/hosts.py: {reason}")
    if args.planes:
        compare_planes(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = generated_model(args, scratch / "qwen3")
        (scratch / "bed").mkdir()
        bed = Namespaces(1, scratch / "bed").start()
        try:
            loopback = [{"ssh": "localhost", "ips": ["127.0.0.1"], "cpus": [core]} for core in (0, 1)]
            across = [bed.entry(-1, cpus=[0]), bed.entry(0, cpus=[1])]
            files = {
                "TP=1, 2 BLAS threads": bed.hostfile([{"ssh": "localhost", "ips": ["127.0.0.1"]}], "tp1.json"),
                "TP=2 on loopback, a core each": bed.hostfile(loopback, "loopback.json"),
                "TP=2 across two hosts (namespaces, veth, sshd), a core each": bed.hostfile(across, "across.json"),
            }
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in files}
            for _ in range(args.rounds):
                for name, hostfile in files.items():
                    child = _child(
                        "--pool", str(model), str(hostfile), bed.ssh_command, str(args.tokens), "direct", "1"
                    )
                    runs[name].append(_result(child))
            allsum = {
                "loopback": collective_ms(["127.0.0.1", "127.0.0.1"], [None, None], args.hidden, scratch),
                "across": collective_ms([bed.leader_ip, bed.ip(0)], [None, bed.namespaces[0]], args.hidden, scratch),
            }
        finally:
            bed.close()

    def median(name: str, part: str) -> float:
        return statistics.median(run[part] for run in runs[name])

    tp1 = median(next(iter(files)), "total")
    per_step = 2 * args.layers
    print(f"model: generated qwen3, hidden {args.hidden}, {args.layers} layers, fp32; {args.tokens} decode steps, ")
    print(f"median of {args.rounds} alternating rounds; collectives: {per_step} all_sums of 1 x {args.hidden} fp32\n")
    print("| setup | step ms | vs TP=1 | fan-out ms | rank 0 ms | of which collectives (est.) ms | drain ms |")
    print("|---|---|---|---|---|---|---|")
    for name in files:
        total = median(name, "total")
        link = "across" if "across" in name else "loopback"
        collectives = f"{allsum[link] * per_step:.1f}" if "TP=2" in name else "-"
        print(
            f"| {name} | {total:.1f} | {total / tp1:.2f}x | {median(name, 'fan_out'):.2f} | "
            f"{median(name, 'rank0'):.1f} | {collectives} | {median(name, 'drain'):.2f} |"
        )
    print(f"\nbare all_sum of 1 x {args.hidden} fp32, median of 500: loopback {allsum['loopback']:.3f} ms, ", end="")
    print(f"across the veth {allsum['across']:.3f} ms")


def compare_planes(args: argparse.Namespace) -> None:
    """TP=2 across two hosts, the ring's link plain TCP on the bridge (direct) or tunnelled through SSH, at one
    stream and at eight: step ms and tokens per second, median of alternating rounds."""
    from testkit.testbed import Namespaces

    runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = generated_model(args, scratch / "qwen3")
        (scratch / "bed").mkdir()
        bed = Namespaces(1, scratch / "bed").start()
        try:
            hostfile = bed.hostfile([bed.entry(-1, cpus=[0]), bed.entry(0, cpus=[1])], "across.json")
            for _ in range(args.rounds):
                for batch in (1, 8):
                    for plane in ("direct", "ssh"):
                        child = _child(
                            "--pool", str(model), str(hostfile), bed.ssh_command, str(args.tokens), plane, str(batch)
                        )
                        runs.setdefault((batch, plane), []).append(_result(child))
                        print(batch, plane, json.dumps(runs[batch, plane][-1]), file=sys.stderr, flush=True)
            echo = echo_ms(bed, scratch)
        finally:
            bed.close()

    def median(key: tuple[int, str], part: str) -> float:
        return statistics.median(run[part] for run in runs[key])

    print(f"model: generated qwen3, hidden {args.hidden}, {args.layers} layers, fp32; {args.tokens} decode steps, ")
    print(f"median of {args.rounds} alternating rounds; TP=2, rank 0 on core 0, rank 1 (other host) on core 1\n")
    print("| streams | data plane | step ms | tokens/s | vs direct | fan-out ms | rank 0 ms | drain ms |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, plane in runs:
        total = median((batch, plane), "total")
        direct = median((batch, "direct"), "total")
        print(
            f"| {batch} | {plane} | {total:.1f} | {batch * 1000 / total:.1f} | {total / direct:.2f}x | "
            f"{median((batch, plane), 'fan_out'):.2f} | {median((batch, plane), 'rank0'):.1f} | "
            f"{median((batch, plane), 'drain'):.2f} |"
        )
    print(f"\n4 KiB echoed back across the bridge, median of {ECHOES}: {echo['direct']:.3f} ms direct, ", end="")
    print(f"{echo['ssh']:.3f} ms through an SSH -L tunnel")


ECHOES = 500
ECHO_SERVER = """
import socket, sys
with socket.create_server((sys.argv[1], int(sys.argv[2]))) as s:
    c, _ = s.accept()
    with c:
        while data := c.recv(1 << 16):
            c.sendall(data)
"""


def echo_ms(bed: Namespaces, scratch: Path) -> dict[str, float]:
    """Round trips of 4 KiB (a 1 x 1024 fp32 activation) to an echo server on the other host: straight to its
    address, and through an ``ssh -L`` to its loopback (one connection each; the median of ``ECHOES``)."""
    import socket

    port = 40000 + os.getpid() % 10000
    inside = ["ip", "netns", "exec", bed.namespaces[0]]
    servers = [
        subprocess.Popen([*inside, sys.executable, "-c", ECHO_SERVER, ip, str(port + i)])
        for i, ip in enumerate([bed.ip(0), "127.0.0.1"])
    ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local = s.getsockname()[1]
    forward = f"127.0.0.1:{local}:127.0.0.1:{port + 1}"
    ssh = [*bed.ssh_command.split(), "-N", "-o", "ExitOnForwardFailure=yes", "-L", forward, f"root@{bed.ip(0)}"]
    tunnel = subprocess.Popen(ssh)
    try:
        out = {}
        for name, address in (("direct", (bed.ip(0), port)), ("ssh", ("127.0.0.1", local))):
            deadline = time.monotonic() + 20
            while True:
                try:
                    conn = socket.create_connection(address, timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                times, message = [], bytes(4096)
                for _ in range(ECHOES):
                    started = time.perf_counter()
                    conn.sendall(message)
                    got = 0
                    while got < len(message):
                        got += len(conn.recv(len(message) - got))
                    times.append(time.perf_counter() - started)
                out[name] = statistics.median(times) * 1000
        return out
    finally:
        tunnel.terminate()
        tunnel.wait(10)
        for server in servers:
            server.kill()
            server.wait(10)


if __name__ == "__main__":
    main()
