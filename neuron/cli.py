"""The ``neuron`` command: ``generate`` (and, hidden, ``--worker`` for the leader's subprocesses).

Imports stay light until the command is known: a worker must pin itself to its
cores before MLX starts any thread, and the leader may re-execute itself with
OpenBLAS preloaded, which only works before MLX is loaded.
"""

from __future__ import annotations

import argparse
import os
import sys

from neuron import __version__

EXIT_USAGE = 2
EXIT_FAILURE = 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron", description="Tensor-parallel LLM inference on MLX.")
    parser.add_argument("--version", action="version", version=f"neuron {__version__}")
    # The worker's entry point: spawned by the leader, never typed by a person.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = commands.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--model", help="model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    gen.add_argument(
        "--backend",
        default="ring",
        choices=("ring", "jaccl", "nccl"),
        help="mx.distributed backend for --tp > 1 (default ring; jaccl and nccl untested here)",
    )
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, help="make sampling reproducible")
    gen.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="seconds a step may take on any rank before it is declared lost (default 120)",
    )
    gen.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="logs go to stderr (default info)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        if args.rank is None or args.world_size is None or not 0 < args.rank < args.world_size:
            parser.error("--worker needs --rank R and --world-size N with 0 < R < N")
        from neuron.worker import serve

        return serve(args.rank, args.world_size)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.tp < 1:
        parser.error(f"--tp must be at least 1, got {args.tp}")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")

    from neuron import cpu

    cpu.reexec_with_openblas()
    return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    import anyio

    from neuron import cpu
    from neuron import log as logging_setup

    logging_setup.configure(args.log_level)
    os.environ["NEURON_LOG_LEVEL"] = args.log_level  # the workers log at the leader's level
    import structlog

    from neuron.engine import Chunk, Engine, RequestError
    from neuron.models import resolve
    from neuron.pool import Deadlines, PoolError
    from neuron.tp.model import ModelError
    from neuron.tp.sampling import SamplingParams

    log = structlog.get_logger("neuron.cli")
    blas = cpu.blas_in_use()
    log.info("starting", blas=blas, tp=args.tp)
    if cpu.is_linux_cpu_backend() and "OpenBLAS" not in blas:
        log.warning(cpu.OPENBLAS_HINT)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.min_p, args.seed)

    async def run() -> None:
        path = resolve(args.model)
        async with Engine.open(path, args.tp, args.backend, Deadlines(step=args.step_timeout)) as engine:
            prompt = engine.encode(args.prompt, chat=args.chat)
            async for item in engine.generate(prompt, args.max_tokens, sampling):
                sys.stdout.write(item.text)
                sys.stdout.flush()
                if not isinstance(item, Chunk):
                    sys.stdout.write("\n")

    try:
        anyio.run(run)
    except (ModelError, RequestError, PoolError, ValueError) as e:
        print(f"neuron: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    return 0
