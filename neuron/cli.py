"""The ``neuron`` command: ``serve`` and ``generate`` (and, hidden, ``--worker`` for the leader's subprocesses).

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
API_KEY_ENV = "NEURON_API_KEY"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron", description="Tensor-parallel LLM inference on MLX.")
    parser.add_argument("--version", action="version", version=f"neuron {__version__}")
    # The worker's entry point: spawned by the leader, never typed by a person.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", help="model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    model.add_argument(
        "--backend",
        default="ring",
        choices=("ring", "jaccl", "nccl"),
        help="mx.distributed backend for --tp > 1 (default ring; jaccl and nccl untested here)",
    )
    model.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="seconds a step may take on any rank before it is declared lost (default 120)",
    )
    model.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="logs go to stderr (default info)",
    )

    serve = commands.add_parser("serve", parents=[model], help="serve an OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require `Authorization: Bearer KEY` on /v1 (default: ${API_KEY_ENV}; unset means no key)",
    )
    serve.add_argument("--max-batch", type=int, default=8, help="sequences decoding together (default 8)")
    serve.add_argument(
        "--max-waiting", type=int, default=64, help="requests queued beyond the batch; more get 429 (default 64)"
    )
    serve.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="prompt tokens fed per step, so long prompts do not stall running streams (default 512)",
    )
    serve.add_argument(
        "--max-context", type=int, help="tokens per request, prompt and completion (default: the model's context)"
    )

    gen = commands.add_parser("generate", parents=[model], help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, help="make sampling reproducible")
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
    if args.step_timeout <= 0:
        parser.error(f"--step-timeout must be positive, got {args.step_timeout}")
    if args.command == "generate":
        from neuron.sampling_params import SamplingParams

        if args.max_tokens < 1:
            parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
        args.sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.min_p, args.seed)
        if problems := args.sampling.problems():
            parser.error("; ".join(problems))
    if args.command == "serve":
        if not 0 <= args.port <= 65535:
            parser.error(f"--port must lie in [0, 65535], got {args.port}")
        if args.max_waiting < 0:
            parser.error(f"--max-waiting must be 0 or more, got {args.max_waiting}")
        for flag in ("max_batch", "prefill_chunk", "max_context"):
            if (value := getattr(args, flag)) is not None and value < 1:
                parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
        if args.api_key is not None and not args.api_key.strip():
            parser.error(f"--api-key (or ${API_KEY_ENV}) is empty; give a key or leave it unset")

    from neuron import cpu

    cpu.reexec_with_openblas()
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    import anyio

    from neuron import cpu
    from neuron import log as logging_setup

    logging_setup.configure(args.log_level)
    os.environ["NEURON_LOG_LEVEL"] = args.log_level  # the workers log at the leader's level
    import structlog

    from neuron.engine.sequence import RequestError
    from neuron.pool import PoolError
    from neuron.tp.model import ModelError

    log = structlog.get_logger("neuron.cli")
    blas = cpu.blas_in_use()
    log.info("starting", blas=blas, tp=args.tp)
    if cpu.is_linux_cpu_backend() and "OpenBLAS" not in blas:
        log.warning(cpu.OPENBLAS_HINT)
    run = _serve if args.command == "serve" else _generate
    try:
        anyio.run(run, args)
    except (ModelError, RequestError, PoolError, RuntimeError, ValueError, OSError) as e:
        print(f"neuron: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    return 0


async def _serve(args: argparse.Namespace) -> None:
    from neuron.engine.engine import Limits
    from neuron.models import model_id, resolve
    from neuron.pool import Deadlines
    from neuron.server.serve import ServeOptions, serve

    await serve(
        ServeOptions(
            model_path=resolve(args.model),
            model_id=model_id(args.model),
            world_size=args.tp,
            backend=args.backend,
            host=args.host,
            port=args.port,
            api_key=args.api_key.strip() if args.api_key else None,
            deadlines=Deadlines(step=args.step_timeout),
            limits=Limits(args.max_batch, args.max_waiting, args.prefill_chunk, args.max_context),
        )
    )


async def _generate(args: argparse.Namespace) -> None:
    from neuron.engine.engine import Engine
    from neuron.engine.sequence import Chunk, Failure
    from neuron.models import resolve
    from neuron.pool import Deadlines

    path = resolve(args.model)
    async with Engine.open(path, args.tp, args.backend, Deadlines(step=args.step_timeout)) as engine:
        if args.chat:
            prompt = engine.encode_chat([{"role": "user", "content": args.prompt}])
        else:
            prompt = engine.encode(args.prompt)
        seq = engine.submit(prompt, args.max_tokens, args.sampling)
        try:
            async for event in seq.events:
                if isinstance(event, Failure):
                    raise RuntimeError(event.message)
                sys.stdout.write(event.text)
                sys.stdout.flush()
                if not isinstance(event, Chunk):
                    sys.stdout.write("\n")
        finally:
            engine.cancel(seq)
