"""The ``neuron`` command: ``serve`` and ``generate``, ``hosts`` for a running leader's hosts, the model cache's
commands (and, hidden, ``--worker`` for the leader's subprocesses).

Imports stay light until the command is known: on the Linux CPU backend a worker
must pin itself to its cores before MLX starts any thread, and the leader may
re-execute itself with OpenBLAS preloaded, which only works before MLX is loaded;
on a GPU backend (``device.py``) none of that runs. A command that runs MLX
re-executes before even the settings are imported (``cpu.reexec_early``): the
process that is replaced should have loaded nothing it throws away.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
from typing import TYPE_CHECKING

from neuron import __version__
from neuron.system import cpu

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from neuron.cli.serve import Restart
    from neuron.launch.launcher import Launcher
    from neuron.pool import Layout

EXIT_USAGE = 2
EXIT_FAILURE = 1


def _parser() -> argparse.ArgumentParser:
    from neuron.config import sources
    from neuron.models import catalog

    parser = argparse.ArgumentParser(prog="neuron", description="Tensor-parallel LLM inference on MLX.")
    parser.add_argument("--version", action="version", version=f"neuron {__version__}")
    # The worker's entry point: spawned by the leader, never typed by a person.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    # A host's end of a push of the model (--push-model): started over SSH by the leader, never by a person.
    parser.add_argument("--receive-share", metavar="KEY", help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    serve.add_argument(
        "--config",
        metavar="PATH",
        help=f"TOML file of settings (default: ${sources.CONFIG_ENV}, else {sources.DEFAULT_CONFIG} when present)",
    )
    sources.add_arguments(serve, "serve")

    gen = commands.add_parser(
        "generate", help="answer one prompt: the text on stdout, progress and a summary on stderr"
    )
    gen.add_argument("prompt", metavar="PROMPT")
    sources.add_arguments(gen, "generate")
    catalog.add_commands(commands)  # pull, models, models rm: the Hugging Face cache (neuron/models/catalog.py)
    from neuron.cli import hosts

    hosts.add_command(commands)  # the running leader's hosts, through its admin routes (neuron/cli/hosts.py)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        if argv is None:  # this process ends: its teardown need not trace every object the imports made
            gc.freeze()


def _main(argv: list[str] | None) -> int:
    from neuron.system import descriptors, device

    descriptors.raise_soft_limit()
    device.return_freed_memory()
    if argv is None:  # the process's own command line, which a re-execution repeats
        cpu.reexec_early(sys.argv[1:])
    from neuron.config import sources
    from neuron.models import catalog

    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        if args.rank is None or args.world_size is None or not 0 < args.rank < args.world_size:
            parser.error("--worker needs --rank R and --world-size N with 0 < R < N")
        from neuron.cli.worker import models_without_tokenizers, run_worker

        try:
            cpu.reexec_with_preloads()  # on a host of its own a worker picks its BLAS there, as the leader did here
        except cpu.PreloadError as e:
            parser.error(f"rank {args.rank}: {e}")
        models_without_tokenizers()
        descriptors.import_mlx_lm()
        return run_worker(args.rank, args.world_size)
    if args.receive_share:
        from neuron.launch.push import run_receiver

        return run_receiver(args.receive_share)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command in catalog.COMMANDS:
        return catalog.run(args)
    if args.command == "hosts":
        from neuron.cli import hosts

        return hosts.run(args)
    problems = sources.resolve(args, args.command)
    if args.command == "serve":
        from neuron.cli import router

        if router.several(args):  # a router of several models, each in a server of its own: no MLX here
            problems += [] if problems else router.problems(args)
            if problems:
                parser.error("; ".join(problems))
            return router.run(args)
        from neuron.models.folder import outside
        from neuron.server.keys import KeysError, load

        if problem := outside(args.model, args.model_dirs):
            problems.append(problem)
        try:  # read again as the server starts (and as a restarted leader starts: an edit takes effect then)
            load(args.api_key, args.api_keys_file)
        except KeysError as e:
            problems.append(str(e))
    if "hosts" in sources.names(args.command):
        problems += _read_hosts(args)
    if args.command == "generate":
        from neuron.sampling_params import SamplingParams

        if args.model is not None and "," in args.model:
            problems.append("generate runs one model: give --model once (serve takes several)")

        args.sampling = sources.build(SamplingParams, args)
        # Each problem starts with the field's name: say it as the flag the user typed.
        problems += ["--" + problem.replace("_", "-", problem.index(" ")) for problem in args.sampling.problems()]
    if problems:
        parser.error("; ".join(problems))

    from neuron.system import device

    try:
        cpu.reexec_with_preloads()
    except cpu.PreloadError as e:
        parser.error(str(e))
    try:
        import mlx.core  # noqa: F401 - loaded here, after the re-exec, to say what to install when it cannot be
    except ImportError as e:
        print(f"neuron: error: {device.cannot_load(e)}", file=sys.stderr)
        return EXIT_FAILURE
    return _run(args)  # it imports mlx-lm once this host's workers have started (``_workers_first``)


def _read_hosts(args: argparse.Namespace) -> list[str]:
    """Read ``--hosts`` and settle ``--tp`` (ranks = tp x pp); the problems found."""
    from neuron.launch.hostfile import check_spare_timeout, read_hostfile
    from neuron.launch.hosts import Host, HostsError, check_hosts, local_hosts
    from neuron.launch.stages import SplitError, parse_split

    spares: tuple[Host, ...] = ()
    try:
        if args.hosts:
            hostfile = read_hostfile(args.hosts)
            hosts, spares = list(hostfile.hosts), hostfile.spares
            tp = args.tp or len(hosts) // args.pp
            if tp * args.pp != len(hosts):
                raise HostsError(
                    f"the hostfile {args.hosts} names {len(hosts)} ranks, but --tp {tp} x --pp {args.pp} makes "
                    f"{tp * args.pp}; give one rank per entry"
                )
        else:
            tp = args.tp or 1
            hosts = local_hosts(tp * args.pp)
        if tp > 1 and args.pp > 1:
            raise HostsError(
                f"--tp {tp} with --pp {args.pp} needs sub-groups of the ranks (MLX's Group.split), which MLX's "
                f"{args.backend} backend cannot make (of its backends only MPI can); use --tp or --pp alone"
            )
        check_hosts(hosts, args.backend, args.data_plane, spares)
        if spares and args.command == "serve":
            check_spare_timeout(args.spare_timeout, args.resume_timeout)
        args.split = tuple(parse_split(args.pp_layers)) if args.pp_layers else ()
        if args.split and args.pp == 1:
            raise HostsError("--pp-layers splits pipeline stages: give --pp too")
        if getattr(args, "micro_batches", 1) > 1 and args.pp == 1:
            raise HostsError("--micro-batches overlaps pipeline stages: give --pp too, or leave it at 1")
    except (HostsError, SplitError) as e:
        return [str(e)]
    args.tp = tp
    args.host_list = hosts
    args.spares = spares
    return []


def _layout(args: argparse.Namespace, launcher: Launcher) -> Layout:
    from neuron.pool import Layout

    timeout = getattr(args, "spare_timeout", None)  # serve's alone: generate has no recovery to move a rank in
    extra = {"spare_timeout": timeout} if timeout is not None else {}
    return Layout(
        launcher, args.backend, args.pp, args.split, args.push_model, args.spares, hostfile=args.hosts, **extra
    )


def _run(args: argparse.Namespace) -> int:
    import anyio

    from neuron import log as logging_setup
    from neuron.config import sources
    from neuron.system import descriptors, device

    # The leader is rank 0; its workers log at its level, in its format (they share its stderr). What MLX's C++
    # writes to stderr (``[ring] ...`` when a peer is lost) becomes entries of its own, never half a JSON line.
    fmt = logging_setup.configure(args.log_level, args.log_format, native_stderr=True, rank=0)
    os.environ[sources.SETTINGS["log_level"].env] = args.log_level
    os.environ[sources.SETTINGS["log_format"].env] = fmt
    import structlog

    from neuron.launch.launcher import Launcher

    log = structlog.get_logger("neuron.cli")
    if cpu.is_linux_cpu_backend():
        blas = cpu.blas_in_use()
        malloc = cpu.malloc_in_use()
        log.info("starting", device=device.this_device(), blas=blas, malloc=malloc, tp=args.tp, pp=args.pp)
        if blas.startswith("reference"):
            log.warning(cpu.BLAS_HINT)
        elif (problem := cpu.gemv_problem()) and not problem.endswith("=off"):
            log.warning(f"one-row products go through sgemm, so batch-1 decode is about 1.5x slower: {problem}")
    else:  # a GPU does its own products: no BLAS, no interposer, no pinning
        log.info("starting", device=device.this_device(), tp=args.tp, pp=args.pp)
        if problem := device.unusable_gpu():
            log.warning(problem)
    run = _serve if args.command == "serve" else _generate
    launcher = Launcher(args.host_list, args.ssh_command, args.data_plane)
    if not launcher.local_workers:  # no worker's start-up to overlap it with: outside the event loop it is quicker
        descriptors.import_mlx_lm()
    try:
        restart = anyio.run(_workers_first, run, args, launcher)
    except BaseException as e:  # what a person should read is found below; anything else is re-raised
        if isinstance(e, ImportError):  # mlx-lm's (or a module it needs): the traceback names it
            raise
        from neuron.engine.refusals import RequestError
        from neuron.models.folder import ModelError
        from neuron.pool import PoolError

        expected = _first_leaf(e, (ModelError, RequestError, PoolError, RuntimeError, ValueError, OSError))
        if isinstance(expected, KeyboardInterrupt):
            return 130
        if expected is None:
            raise
        print(f"neuron: error: {expected}", file=sys.stderr)
        leave_if_rank0_is_busy(EXIT_FAILURE)
        return EXIT_FAILURE
    if restart is not None:
        from neuron.cli.serve import restart_leader

        restart_leader(restart)
    leave_if_rank0_is_busy(0)
    return 0


def leave_if_rank0_is_busy(code: int) -> None:
    """Exit now with ``code``, skipping the interpreter's teardown, while a rank-0 thread (``neuron-rank0``,
    pool/rank0.py) is still inside MLX. No MLX here: the command line imports this module before MLX.

    Abandoned in a load or a step when a peer failed, it comes out (or never does) after the main thread has begun
    to finalize: Python then ends it where it waits for the GIL, inside MLX's C++ frames, and the C++ runtime
    aborts the process (SIGABRT) after its output was written. A restart's exec skips the teardown the same way.
    """
    if any(thread.name == "neuron-rank0" and thread.is_alive() for thread in threading.enumerate()):
        from neuron import log

        log.release_native_stderr()  # os._exit runs no atexit: the pipe's last lines are relayed here
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _first_leaf(error: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The failure a person should read: task groups wrap what was raised in exception groups."""
    if isinstance(error, BaseExceptionGroup):
        found = (_first_leaf(inner, kinds) for inner in error.exceptions)
        return next((leaf for leaf in found if leaf is not None), None)
    return error if isinstance(error, (*kinds, KeyboardInterrupt)) else None


async def _workers_first(
    run: Callable[[argparse.Namespace, Launcher], Awaitable[Restart | None]],
    args: argparse.Namespace,
    launcher: Launcher,
) -> Restart | None:
    """Start this host's workers, then import mlx-lm (most of a start-up, in the leader and in each worker alike),
    then ``run``: the workers' imports run while the leader's do, where they used to follow them."""
    from neuron.system import descriptors

    try:
        await launcher.start_early(args.backend)
        descriptors.import_mlx_lm()  # blocks the loop, which has nothing to do until the pool takes the workers
        return await run(args, launcher)
    finally:
        await launcher.end_early()


async def _serve(args: argparse.Namespace, launcher: Launcher) -> Restart | None:
    from neuron import images
    from neuron.cli.serve import ServeOptions, run_leader
    from neuron.config import sources
    from neuron.config.settings import HttpLimits, ImageLimits, Scheduling, Serving
    from neuron.models.folder import model_id, resolve
    from neuron.models.hub import parse
    from neuron.pool import Deadlines

    images.LIMITS = sources.build(ImageLimits, args)
    return await run_leader(
        ServeOptions(
            model_path=None if parse(args.model) else resolve(args.model),  # a Hub name is fetched once serving
            model=args.model,
            model_id=args.served_model_name or model_id(args.model),
            layout=_layout(args, launcher),
            serving=sources.build(Serving, args),
            http=sources.build(HttpLimits, args),
            deadlines=Deadlines(step=args.step_timeout),
            limits=sources.build(Scheduling, args),
        )
    )


async def _generate(args: argparse.Namespace, launcher: Launcher) -> None:
    from neuron.cli.generate import generate

    await generate(args, _layout(args, launcher))
