"""Decode speed of one streaming HTTP client against raw mlx-lm, on the same model, in the same run.

Run: .venv/bin/python bench/http_decode.py [--model FOLDER | --generate 2048,8,32,5888] [--tokens 128] [--rounds 5]
         [--serve '--run-ahead off' ...] [--checkout DIR ...] [--light-client] [--otlp-sink]

The baseline is ``mlx_lm.stream_generate`` in its own process with the same
BLAS neuron uses (OpenBLAS preloaded when present, behind neuron's one-row
interposer where it builds). The contenders are neuron's
engine in a process of its own (what ``neuron generate`` runs, less the process
start) and a real ``neuron serve`` answering a streamed ``/v1/completions``
request. All three alternate, round by round, so that the machine's noise hits
them alike. ``--checkout`` adds a ``neuron serve`` run from another checkout of
neuron (``git archive COMMIT | tar -x -C DIR``), to compare two commits in one run.
Decode rate is (tokens - 1) / (time from first to last token): prefill excluded.
CPU ms/token is the process's user+system time per token: on a machine shared with other work it moves less
than wall time, and for a tiny model it is mostly host time. Client CPU ms/token is this process's, the client's:
on two cores it competes with the server's step. ``--light-client`` measures each server a second time per round
with a client that reads the stream from a bare socket and parses no event but the last (rows marked so): the
server's rate where its client costs next to nothing; the headline stays with the httpx client.
Prints a markdown table; the ratio is what to trust, not the absolute rates. "Round by round" is the
lowest and highest of each round's rate over mlx-lm's in the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from streaming import stream_completion, stream_completion_light

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def baseline_child(model: str, tokens: int) -> None:
    """A persistent baseline: one greedy generation per line read on stdin, one JSON result per line out."""
    from mlx_lm import load, stream_generate

    loaded_model, tokenizer = load(model)
    for _ in sys.stdin:
        stamps, cpu = [], []
        for _response in stream_generate(loaded_model, tokenizer, PROMPT, max_tokens=tokens):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
        print(json.dumps(_result(stamps, cpu[-1] - cpu[0])), flush=True)


def engine_child(model: str, tokens: int) -> None:
    """``neuron generate``'s path without the process start: the engine at TP=1, one generation per stdin line."""
    import anyio

    sys.path.insert(0, str(ROOT))
    from neuron.engine.engine import Engine
    from neuron.engine.scheduler import Scheduling
    from neuron.engine.sequence import Chunk
    from neuron.sampling_params import SamplingParams

    async def serve() -> None:
        async with Engine.open(Path(model), limits=Scheduling(prefix_cache_bytes=0)) as engine:  # as generate runs it
            prompt = engine.text.encode(PROMPT)
            while await anyio.to_thread.run_sync(sys.stdin.readline):
                stamps, cpu = [], []
                seq = engine.submit(prompt, SamplingParams(max_tokens=tokens))
                async for event in seq.events:
                    if isinstance(event, Chunk):
                        stamps.append(time.perf_counter())
                        cpu.append(time.process_time())
                print(json.dumps(_result(stamps, cpu[-1] - cpu[0])), flush=True)

    anyio.run(serve)


def _result(stamps: list[float], cpu_seconds: float) -> dict:
    return {"tokens": len(stamps), "seconds": stamps[-1] - stamps[0], "cpu_seconds": cpu_seconds}


def process_cpu_seconds(pid: int) -> float:
    """User plus system time of ``pid`` and its threads so far (Linux), to count a server's CPU per token."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def blas_env() -> dict[str, str]:
    sys.path.insert(0, str(ROOT))
    from neuron.system import cpu

    env = dict(os.environ)
    if cpu.is_linux_cpu_backend() and (lib := cpu.find_blas()):
        # What neuron preloads: one-row products by sgemv where it can, then the library.
        env["LD_PRELOAD"] = ":".join(cpu.preload_for(lib)[0])
    return env


def http_round(url: str, model_id: str, tokens: int, pid: int, light: bool = False) -> dict:
    cpu_before, client_before = process_cpu_seconds(pid), time.process_time()
    streamed = (stream_completion_light if light else stream_completion)(url, model_id, PROMPT, tokens)
    cpu = process_cpu_seconds(pid) - cpu_before  # prefill included: clock ticks are too coarse to split it off
    client = time.process_time() - client_before  # this process is the client
    # Text can lag a token (a partial character), so time spans first to last text, counted in tokens.
    seconds = streamed.text_at[-1] - streamed.text_at[0]
    return {"tokens": streamed.tokens, "seconds": seconds, "cpu_seconds": cpu, "client_seconds": client}


def persistent(flag: str, path: Path, tokens: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, flag, str(path), str(tokens)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=blas_env(),
        cwd=ROOT,
    )


def take_round(child: subprocess.Popen[str]) -> dict:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    return json.loads(child.stdout.readline())


def _otlp_sink() -> str:
    """Start a loopback receiver that answers every OTLP/HTTP export with 200 and keeps nothing; its URL."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", nargs=2, metavar=("MODEL", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--engine", nargs=2, metavar=("MODEL", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help="model folder or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--generate", metavar="HIDDEN,LAYERS,HEADS,INTERMEDIATE", help="a generated qwen3 instead")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument(
        "--serve",
        action="append",
        metavar="FLAGS",
        help="a neuron serve to measure beside the default one, by its extra flags ('--run-ahead off'); repeatable",
    )
    parser.add_argument(
        "--checkout",
        action="append",
        metavar="DIR",
        help="a neuron serve run from another checkout of neuron, beside this one's; repeatable",
    )
    parser.add_argument(
        "--otlp-sink",
        action="store_true",
        help="a receiver that takes OTLP/HTTP exports and drops them; {otlp} in a --serve row is its URL, so that a "
        "row measures requests traced with --otlp-traces-endpoint",
    )
    parser.add_argument(
        "--light-client",
        action="store_true",
        help="measure each neuron serve a second time per round with a bare-socket client (rows marked so)",
    )
    args = parser.parse_args()
    if args.baseline:
        baseline_child(args.baseline[0], int(args.baseline[1]))
        return
    if args.engine:
        engine_child(args.engine[0], int(args.engine[1]))
        return

    sys.path.insert(0, str(ROOT))
    from neuron.models.folder import model_id, resolve
    from testkit import Server, make_tiny_model

    scratch = Path(tempfile.mkdtemp())
    if args.generate:
        hidden, layers, heads, intermediate = (int(x) for x in args.generate.split(","))
        args.model = str(make_tiny_model(scratch / "qwen3", "qwen3", 0, hidden, layers, heads, intermediate))
    path = resolve(args.model)
    served_id = model_id(args.model)
    common = [*(["--model", args.model] if args.model else []), "--tp", str(args.tp)]
    sink = _otlp_sink() if args.otlp_sink else ""
    variants = {"": [], **{flags: flags.format(otlp=sink).split() for flags in args.serve or []}}
    servers = {
        name: Server(*common, *flags, log_path=scratch / f"log{i}") for i, (name, flags) in enumerate(variants.items())
    }
    for i, checkout in enumerate(args.checkout or []):
        # PYTHONSAFEPATH: ``python -m neuron`` must not import this checkout from its working directory.
        env = {"PYTHONPATH": str(Path(checkout).resolve()), "PYTHONSAFEPATH": "1"}
        servers[f"from {checkout}"] = Server(*common, log_path=scratch / f"checkout{i}", env=env)
    children = {
        "mlx_lm": persistent("--baseline", path, args.tokens),
        "engine": persistent("--engine", path, args.tokens),
    }
    try:
        for server in servers.values():
            server.start()
        clients = {"http": False, **({"light": True} if args.light_client else {})}
        results: dict[str, list[dict]] = {
            "mlx_lm": [],
            "engine": [],
            **{f"{client}{name}": [] for client in clients for name in servers},
        }
        for warmup in (True,) + (False,) * args.rounds:
            measured = {name: take_round(child) for name, child in children.items()}
            for name, server in servers.items():
                for client, light in clients.items():
                    measured[f"{client}{name}"] = http_round(
                        server.url, served_id, args.tokens, server.process.pid, light
                    )
            if not warmup:
                for name, result in measured.items():
                    results[name].append(result)
    finally:
        for child in children.values():
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=60)
        for server in servers.values():
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    def rate(r: dict) -> float:
        return (r["tokens"] - 1) / r["seconds"]

    def cpu_ms(r: dict) -> float:
        return r["cpu_seconds"] * 1000 / (r["tokens"] - 1)

    rates = {name: statistics.median(rate(r) for r in rs) for name, rs in results.items()}
    cpus = {name: statistics.median(cpu_ms(r) for r in rs) for name, rs in results.items()}
    base = rates["mlx_lm"]
    print(f"model {path.name}, TP={args.tp}, {args.tokens} tokens, median of {args.rounds} alternating rounds\n")
    print(
        "| path | decode tok/s (median) | tokens/round | vs mlx_lm | round by round | CPU ms/token | CPU vs mlx_lm "
        "| client CPU ms/token |"
    )
    print("|---|---|---|---|---|---|---|---|")
    kinds = {"http": "one streaming HTTP client", "light": "a bare-socket client (--light-client)"}
    names = {
        "mlx_lm": "mlx_lm.stream_generate",
        "engine": "neuron's engine, TP=1 (what `neuron generate` runs)",
        **{
            f"{client}{name}": f"neuron serve TP={args.tp} {name}".rstrip() + f", {kinds[client]}"
            for client in clients
            for name in servers
        },
    }
    for name, label in names.items():
        # Each round against mlx-lm's of the same round: the spread that the machine's drift leaves.
        ratios = sorted(rate(r) / rate(b) for r, b in zip(results[name], results["mlx_lm"], strict=True))
        spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}x"
        row = f"| {label} | {rates[name]:.1f} | {results[name][0]['tokens']} | {rates[name] / base:.2f}x | {spread} "
        client = (
            f"{statistics.median(r['client_seconds'] * 1000 / (r['tokens'] - 1) for r in results[name]):.2f}"
            if "client_seconds" in results[name][0]
            else ""
        )
        print(row + f"| {cpus[name]:.2f} | {cpus[name] / cpus['mlx_lm']:.2f}x | {client} |")
    # A --serve row against the plain server, round by round (each pair ran back to back): what the flags cost.
    for client in clients:
        for name in servers:
            if not name:
                continue
            pairs = list(zip(results[f"{client}{name}"], results[client], strict=True))
            slower = sorted(rate(b) / rate(r) for r, b in pairs)
            cpu = sorted(cpu_ms(r) / cpu_ms(b) for r, b in pairs)
            print(
                f"\n{client} `{name}` against the plain server, round by round: time per token "
                f"{statistics.median(slower):.3f}x (median; {slower[0]:.3f}-{slower[-1]:.3f}x), CPU per token "
                f"{statistics.median(cpu):.3f}x ({cpu[0]:.3f}-{cpu[-1]:.3f}x), over {len(pairs)} rounds"
            )


if __name__ == "__main__":
    main()
