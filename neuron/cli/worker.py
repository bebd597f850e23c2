"""The worker: one rank above 0, serving the leader's requests over stdin/stdout.

A plain synchronous loop on the main thread, because a rank's MLX state must
stay on the thread that made it. Between steps the worker waits on its
blocking stdin, never inside a collective: a rank spinning in a collective for
a late peer burns most of a core.

Its stdout carries the protocol and nothing else. At start it keeps a private
handle on the real stdout and points fd 1 at stderr, so a stray ``print`` from
any library lands in the logs instead of corrupting the stream.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import TYPE_CHECKING, BinaryIO, NoReturn

import structlog

from neuron import log as logging_setup
from neuron import rpc
from neuron.config.settings import SETTINGS
from neuron.launch import cgroup
from neuron.launch.dataplane import Listeners, probe
from neuron.launch.holder import hold, hold_silently, release
from neuron.launch.hosts import MemoryGauge, describe_host
from neuron.launch.watchdog import start_sentinel
from neuron.models import shares
from neuron.models.folder import ModelError, digest_files, model_digest, resolve
from neuron.rpc import ErrorKind
from neuron.step import Step
from neuron.system import cpu, device

if TYPE_CHECKING:
    from neuron.rank.rank import Rank


def models_without_tokenizers() -> None:
    """Let this process import mlx-lm's models, its loader and caches without transformers.

    mlx-lm's package ``__init__`` imports its generate and convert modules, and ``mlx_lm.utils`` imports its
    tokenizer module: each imports transformers, whose start reads every model file it ships, most of a CPU-second
    on each worker's start. A worker loads and runs its share but never tokenizes (rank 0 does, in the leader), so
    here the package is registered without running its ``__init__``, and the tokenizer module is one that says so
    if anything calls it.
    """
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None:
        return  # the import below names what is missing
    sys.modules["mlx_lm"] = importlib.util.module_from_spec(spec)

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a worker does not tokenize: rank 0, in the leader, does")

    tokenizers = types.ModuleType("mlx_lm.tokenizer_utils", "mlx-lm's tokenizers, which a worker never uses")
    tokenizers.TokenizerWrapper = refuse  # type: ignore[attr-defined]
    tokenizers.load = refuse  # type: ignore[attr-defined]
    sys.modules["mlx_lm.tokenizer_utils"] = tokenizers


def _take_stdout() -> BinaryIO:
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol_out


def read_line(stream: BinaryIO) -> bytes | None:
    """The next line, or None at EOF; an over-long line is consumed and reported as a ProtocolError."""
    line = stream.readline(rpc.MAX_LINE_BYTES + 1)
    if not line:
        return None
    if len(line) > rpc.MAX_LINE_BYTES:
        # Discard the rest of the line so the next read starts at a fresh request.
        size = len(line)
        while line and not line.endswith(b"\n"):
            line = stream.readline(1 << 16)
            size += len(line)
        raise rpc.ProtocolError(
            ErrorKind.LINE_TOO_LONG, f"request line of {size} bytes exceeds the cap of {rpc.MAX_LINE_BYTES}"
        )
    return line


class NotReady(RuntimeError):
    """A request this worker cannot serve yet (it has not joined the group); the group is still in step."""


class Worker:
    """One rank above 0 between requests: its data-plane listeners, then its ``Rank`` (MLX loads with it)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.listeners = Listeners()
        self.state: Rank | None = None
        self.in_step: tuple[type[Exception], ...] = (NotReady,)  # failures that leave the group in step
        self.memory = MemoryGauge()  # its reading rides on a step's reply every few seconds (the status route's)
        self.log = structlog.get_logger("neuron.worker")

    def handle(self, request: rpc.Request) -> rpc.Reply:
        match request:
            case rpc.Ping(id=id):
                return rpc.Pong(
                    id, self.rank, self.world_size, rpc.PROTOCOL_VERSION, os.getpid(), describe_host(self.rank)
                )
            case rpc.Listen(id=id, ips=ips):
                return rpc.Listening(id=id, addresses=self.listeners.open(ips))
            case rpc.Probe(id=id, addresses=addresses):
                return rpc.Probed(id=id, unreachable=probe(addresses))
            case rpc.Init(id=id, backend=backend, env=env, files=files, settings=settings):
                return rpc.InitOk(id=id, all_sum=self._init(backend, env, files, settings))
            case rpc.CheckModel(id=id, model=model, share=share, weights=weights, token=token):
                if token:  # for huggingface_hub, which reads it from the environment on each request
                    os.environ["HF_TOKEN"] = token
                try:
                    path = resolve(model, weights=weights or None)
                except ModelError as e:
                    if share:  # the leader sends its share when this host holds no model of its own
                        return rpc.ModelChecked(id=id, path=str(model), files={}, share=self._held(share))
                    raise ModelError(
                        f"{e} (on this host: copy the model here, name its path here in the hostfile's 'model', "
                        "or pass --push-model to have the leader send it)"
                    ) from e
                files = digest_files(path)
                same = share.split("/")[0] == model_digest(files)
                return rpc.ModelChecked(id=id, path=str(path), files=files, share="" if same else self._held(share))
            case rpc.LoadShare(id=id, model_path=path, layers=layers, kv_bits=kv_bits):
                loaded = self._joined().load(path, layers, kv_bits)
                cgroup.forget_file_pages(path, self.memory.group)
                self.log.info(
                    "share loaded", model=path, parameters=loaded.parameters, seconds=round(loaded.seconds, 2)
                )
                return rpc.LoadShareOk(id=id, parameters=loaded.parameters, seconds=loaded.seconds)
            case rpc.LoadAdapter(id=id, adapter=adapter, name=name, path=path):
                projections = self._joined().load_adapter(adapter, name, path)
                self.log.info("adapter loaded", adapter=name, number=adapter, projections=projections)
                return rpc.AdapterLoaded(id=id, projections=projections)
            case rpc.UnloadAdapter(id=id, adapter=adapter):
                self._joined().unload_adapter(adapter)
                return rpc.AdapterUnloaded(id=id)
            case rpc.GenerateStep(id=id, plan=plan, read_memory=read_memory):
                from neuron.rank.rank import run  # loaded with the rank, in ``_init``

                rank = self._joined()
                stepped = run(rank, Step(plan))  # the step rank 0 runs too, less the sampling
                memory = self.memory.read(lambda: (rank.held.nbytes(), rank.peak)) if read_memory else None
                return rpc.GenerateStepOk(id=id, fingerprint=stepped.fingerprint, memory=memory)
            case rpc.ReadMemory(id=id, memory_limit=memory_limit, cache_limit=cache_limit):
                state = self.state
                if state is not None and memory_limit:
                    state.limit_memory(memory_limit, cache_limit)
                held = (lambda: (state.held.nbytes(), state.peak)) if state is not None else None
                return rpc.MemoryRead(id=id, memory=self.memory.read(held))
            case rpc.ClearKvCache(id=id, prefixes=prefixes):
                if self.state is not None:
                    self.state.clear_kv_cache(prefixes)
                return rpc.KvCacheCleared(id=id)
            case rpc.OpenPrefixDisk(id=id, folder=folder, budget=budget, stamp=stamp):
                return rpc.PrefixDiskOpened(id=id, saved=self._joined().open_disk(folder, budget, stamp))
            case rpc.LoadPrefixes(id=id, entries=entries, drop=drop):
                return rpc.PrefixesLoaded(id=id, failed=self._joined().held.entries.load(entries, drop))
            case rpc.FlushPrefixDisk(id=id):
                return rpc.PrefixDiskFlushed(id=id, written=self._joined().flush_disk(rpc.FLUSH_S))
            case rpc.Shutdown(id=id):
                return rpc.Bye(id=id)
        raise AssertionError(f"unhandled request {request!r}")

    def _held(self, share: str) -> str:
        """The folder of ``share`` when this host holds it whole and unchanged; empty otherwise."""
        if not share:
            return ""
        where = shares.folder(share)
        return str(where) if shares.intact(where) else ""

    def _init(self, backend: str, env: dict[str, str], files: dict[str, str], settings: rpc.WorkerSettings) -> float:
        """Take the leader's settings, pin to the planned cores (Linux CPU only), load MLX, and join the group."""
        if self.state is not None:
            raise NotReady(f"rank {self.rank}: already initialized; a new group needs a new process")
        self.listeners.close()  # MLX binds the same ports next
        logging_setup.configure(settings.log_level, settings.log_format, rank=self.rank, host=settings.host)
        self.log = structlog.get_logger("neuron.worker")
        pinned = settings.cpus if cpu.is_linux_cpu_backend() else []
        if pinned:
            cpu.pin(pinned)  # before MLX starts any thread, so its threads inherit the mask

        try:
            from neuron.rank.rank import Rank, RankError  # MLX loads here, after pinning
        except ImportError as e:
            raise RuntimeError(device.cannot_load(e)) from e

        if pinned:
            cpu.set_blas_threads(len(pinned))
        self.in_step = (NotReady, RankError)
        blas = {"blas": cpu.blas_in_use(), "malloc": cpu.malloc_in_use()} if cpu.is_linux_cpu_backend() else {}
        self.log.info(
            "worker started",
            pid=os.getpid(),
            world_size=self.world_size,
            device=device.this_device(),
            cpus=pinned,
            **blas,
        )
        self.state = Rank(self.rank, self.world_size)
        total = self.state.init_group(backend, env, files)
        if backend == "ring":  # its connections outlive it, answered, should it die (``launch.holder``)
            hold(files["MLX_HOSTFILE"])
        return total

    def _joined(self) -> Rank:
        if self.state is None:
            raise NotReady(f"rank {self.rank}: not in a group yet; send init, then load_share")
        return self.state

    def failure_kind(self, request: rpc.Request, error: Exception) -> ErrorKind:
        if isinstance(request, rpc.Listen | rpc.Probe | rpc.Init):
            return ErrorKind.INIT_FAILED
        if isinstance(request, rpc.CheckModel | rpc.LoadShare | rpc.LoadAdapter | rpc.UnloadAdapter):
            return ErrorKind.LOAD_FAILED
        if isinstance(error, self.in_step):
            return ErrorKind.BAD_STATE
        if isinstance(request, rpc.GenerateStep):
            return ErrorKind.OUT_OF_MEMORY if device.out_of_memory(error) else ErrorKind.GROUP_FAILED
        return ErrorKind.INTERNAL


def _leave_held() -> NoReturn:
    """Leave with the ring's connections held open, unanswered (``holder.hold_silently``): a pipe to the leader
    that closed may be an SSH session cut under a leader that lives on, its rank 0 still in the group, perhaps
    inside a step. At once, without the interpreter's teardown: MLX's would shut the connections down, under the
    holder's copies too."""
    hold_silently()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_worker(rank: int, world_size: int) -> int:
    """Serve the leader's requests until it says shutdown or goes away; the exit status."""
    protocol_out = _take_stdout()
    stdin = sys.stdin.buffer
    start_sentinel()  # ends this process if the leader goes while MLX holds it (``launch.watchdog``)
    # Until the leader's settings arrive (in init), log as a local leader configured us, else as JSON. MLX's own
    # writes to stderr become entries, as in the leader: a local worker shares the leader's stderr, and a piece
    # of MLX's output would otherwise land inside another process's JSON line.
    level, fmt = SETTINGS["log_level"], SETTINGS["log_format"]
    logging_setup.configure(
        os.environ.get(level.env, level.default), os.environ.get(fmt.env, fmt.default), native_stderr=True, rank=rank
    )
    worker = Worker(rank, world_size)
    while True:
        request: rpc.Request | None = None
        try:
            line = read_line(stdin)
            if line is None:
                worker.log.info("stdin closed; the leader is gone, exiting")
                _leave_held()
            request = rpc.decode_request(line)
            reply = worker.handle(request)
        except rpc.ProtocolError as e:
            worker.log.warning("bad request", kind=e.kind.value, error=e.message)
            reply = rpc.Error(id=e.request_id, kind=e.kind, message=f"rank {rank}: {e.message}")
        except Exception as e:  # noqa: BLE001 - every failure becomes an error reply
            assert request is not None
            kind = worker.failure_kind(request, e)
            worker.log.error("request failed", op=request.op, kind=kind.value, error=str(e))
            message = str(e) if str(e).startswith(f"rank {rank}") else f"rank {rank}: {type(e).__name__}: {e}"
            reply = rpc.Error(id=request.id, kind=kind, message=message)
        try:
            protocol_out.write(rpc.encode(reply))
            protocol_out.flush()
        except BrokenPipeError:
            worker.log.info("stdout closed; the leader is gone, exiting")
            _leave_held()
        if isinstance(request, rpc.Shutdown):
            worker.log.info("shutdown requested; bye")
            release()  # leaving in order: its connections' holder leaves too, answering nothing
            return 0
        if worker.state is not None:
            worker.state.ahead.settle()
