"""The Linux CPU fast path: a fast BLAS for every rank, and one block of cores per rank.

Nothing here imports MLX, on purpose: what BLAS a process uses and where its
threads may run must be settled before MLX (and the BLAS it links) is loaded.

Why a BLAS at all: the ``mlx[cpu]`` wheel links the reference BLAS, 1.5-2.6
GFLOP/s on fp32 matmuls; ``libmlx.so`` imports ``cblas_sgemm`` unversioned, so
preloading any library that exports it replaces it (a 512-token prompt about 12x faster).
A library can only be preloaded before a process starts, so the leader
re-executes itself once, and hands the same preload to its workers.

Which one: OpenBLAS first, then BLIS, chosen by ``bench/blas.py`` end to end
(time to first token, one stream's decode, eight streams together) through
``neuron serve``: with one-row products on its sgemv, OpenBLAS won or tied every
column (BLIS: prefill 2.3x slower, eight streams 1.6x); BENCHMARKS.md, "Which BLAS".
``NEURON_BLAS`` picks another: ``openblas``, ``blis``, ``reference`` (none),
or the path of any library exporting ``cblas_sgemm``.

Why an interposer ahead of the BLAS: MLX sends every product to ``cblas_sgemm``,
and at one row (decode at batch 1) sgemm packs the weights before it multiplies,
reading them at a third of the bandwidth; ``neuron/system/native/gemv.c``, built here
once where there is a C compiler, sends those to ``cblas_sgemv`` instead
(BENCHMARKS.md, "Decode toward the bandwidth"). ``NEURON_GEMV=off`` turns it off.

Why jemalloc: MLX's CPU backend allocates each operation's output with ``malloc`` on the thread that evaluates,
and its stream's thread frees it; glibc's malloc serves that hand-over slowly (a chain of small operations took
about twice as long a node). jemalloc, preloaded beside the BLAS where it is installed, serves it in per-thread
caches (BENCHMARKS.md, "A malloc for MLX's hand-over"). Its freed pages go back to the system within a second, from
a thread of its own (``MALLOC_CONF``, unless the operator sets one), so that a rank's memory still says what it
holds (``system.device.return_freed_memory`` does the same for glibc's). ``NEURON_MALLOC=off`` keeps glibc's;
a path preloads another.

Why pinning: two ranks floating over two shared cores starve each other (a small
all-reduce took 7-8 ms, measured while the ring's socket threads still spun as
they waited; ``system.sockets.calm`` makes them sleep); pinned, each to its own
core, 50-180 us.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from neuron.system import device
from neuron.system.reexec import reexec

PRELOAD_ENV = "LD_PRELOAD"
BLAS_ENV = "NEURON_BLAS"  # openblas, blis, reference (none), or a library's path
REEXEC_GUARD = "NEURON_REEXECED"
GEMV_ENV = "NEURON_GEMV"  # "off": one-row products stay on the BLAS's own sgemm
GEMV_PROBLEM_ENV = "NEURON_GEMV_PROBLEM"  # why the re-executed process runs without the interposer
MALLOC_ENV = "NEURON_MALLOC"  # "off": glibc's own malloc; or the path of another malloc library
MALLOC_CONF_ENV = "MALLOC_CONF"  # jemalloc's own settings
JEMALLOC_FILES = (  # where distributions install it, {arch} for the machine
    "/usr/lib/{arch}-linux-gnu/libjemalloc.so.2",  # Debian, Ubuntu
    "/usr/lib64/libjemalloc.so.2",  # Fedora, RHEL
    "/usr/lib/libjemalloc.so.2",  # Arch
)
# Freed pages back to the system within a second, by a thread of jemalloc's, rather than its default ten seconds
# and only when the process next allocates: an idle server's memory says what it holds. Blocks from glibc's mmap
# threshold up (a KV cache's arrays, a prompt's activations) come from jemalloc's arena for oversize blocks, which
# gives their pages back as they are freed: under a memory limit, caches grown and freed within the second would
# otherwise read as held, and the memory budget would shrink under requests it had admitted.
JEMALLOC_CONF = (
    f"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,oversize_threshold:{device.MMAP_THRESHOLD}"
)


@dataclass(frozen=True, slots=True)
class Library:
    name: str
    files: tuple[str, ...]  # where distributions install its threaded build, {arch} for the machine
    threads_symbol: str  # sets its thread count at run time
    packages: str  # how to get it


LIBRARIES = (  # in order of preference: see the module's docstring
    Library(
        "OpenBLAS",
        (
            "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",  # Debian, Ubuntu
            "/usr/lib64/libopenblasp.so.0",  # Fedora, RHEL: the pthreads build
            "/usr/lib64/libopenblas.so.0",
            "/usr/lib/libopenblas.so.0",  # Arch
        ),
        "openblas_set_num_threads",
        "Debian/Ubuntu: apt-get install libopenblas0-pthread; Fedora: dnf install openblas-threads",
    ),
    Library(
        "BLIS",
        ("/usr/lib/{arch}-linux-gnu/blis-pthread/libblis.so.4", "/usr/lib64/libblis-threads.so.4"),
        "bli_thread_set_num_threads",
        "Debian/Ubuntu: apt-get install libblis4-pthread",
    ),
)


class PreloadError(ValueError):
    """An environment variable names a library this process cannot preload."""


class BlasError(PreloadError):
    """``NEURON_BLAS`` names something that cannot serve MLX's matmuls."""


class MallocError(PreloadError):
    """``NEURON_MALLOC`` names something that cannot be preloaded."""


def is_linux_cpu_backend() -> bool:
    """Linux with the CPU build of MLX: the one place this fast path serves (a GPU does its products itself)."""
    return sys.platform == "linux" and device.backend() == "cpu"


def installed(library: Library) -> str | None:
    return _first_file(library.files)


def _first_file(files: tuple[str, ...]) -> str | None:
    """The first of ``files`` ({arch} for the machine) that this host has."""
    arch = platform.machine()
    return next((f for f in (f.format(arch=arch) for f in files) if Path(f).is_file()), None)


def find_blas() -> str | None:
    """The library to preload: ``NEURON_BLAS``'s choice, else the first of ``LIBRARIES`` installed; None for the
    reference BLAS. Raises ``BlasError`` when ``NEURON_BLAS`` names one that is missing or is no cblas library."""
    choice = os.environ.get(BLAS_ENV, "")
    if choice == "reference":
        return None
    if not choice:
        return next(filter(None, map(installed, LIBRARIES)), None)
    by_name = {library.name.lower(): library for library in LIBRARIES}
    if (library := by_name.get(choice.lower())) is not None:
        if (path := installed(library)) is None:
            raise BlasError(f"{BLAS_ENV}={choice}: {library.name} is not installed ({library.packages})")
        return path
    if not Path(choice).is_file():
        raise BlasError(
            f"{BLAS_ENV}={choice}: no such file; give openblas, blis, reference or the path of a cblas library"
        )
    try:
        exports = hasattr(ctypes.CDLL(choice), "cblas_sgemm")
    except OSError as e:
        raise BlasError(f"{BLAS_ENV}={choice}: cannot be loaded: {e}") from None
    if not exports:
        raise BlasError(f"{BLAS_ENV}={choice}: exports no cblas_sgemm, so MLX would not use it")
    return choice


BLAS_HINT = (
    "MLX is using its bundled reference BLAS, which is slow on CPU (prefill about 12x slower): run "
    "scripts/fast-blas as root, or install OpenBLAS yourself (" + LIBRARIES[0].packages + ")"
)


def preloaded_blas() -> str | None:
    """The BLAS this process was started with (the first preloaded library that is one)."""
    for path in filter(None, os.environ.get(PRELOAD_ENV, "").split(":")):
        if path == os.environ.get(BLAS_ENV) or any(Path(path).name.startswith(_stem(lib)) for lib in LIBRARIES):
            return path
    return None


def _stem(library: Library) -> str:
    return Path(library.files[0]).name.split(".")[0]


def preload_for(library: str) -> tuple[list[str], str | None]:
    """What to preload for ``library``: the interposer that sends one-row products to ``cblas_sgemv`` ahead of
    it (``neuron/native``), where it can be had, then the library; and why not, where it cannot."""
    if os.environ.get(GEMV_ENV) == "off":
        return [library], f"{GEMV_ENV}=off"
    if not hasattr(ctypes.CDLL(library), "cblas_sgemv"):
        return [library], f"{library} exports no cblas_sgemv"
    from neuron.system.native import build_gemv

    built = build_gemv()
    if built.path is None:
        return [library], built.problem
    return [str(built.path), library], None  # the interposer first: it calls on the sgemm found after it


def find_malloc() -> str | None:
    """The malloc library to preload: ``NEURON_MALLOC``'s path, else jemalloc where it is installed; None for
    glibc's own. Raises ``MallocError`` when ``NEURON_MALLOC`` names a file that is missing or cannot be loaded."""
    choice = os.environ.get(MALLOC_ENV, "")
    if choice == "off":
        return None
    if not choice:
        return _first_file(JEMALLOC_FILES)
    if not Path(choice).is_file():
        raise MallocError(f"{MALLOC_ENV}={choice}: no such file; give off or the path of a malloc library")
    try:
        ctypes.CDLL(choice)
    except OSError as e:
        raise MallocError(f"{MALLOC_ENV}={choice}: cannot be loaded: {e}") from None
    return choice


def preloads() -> tuple[list[str], dict[str, str]]:
    """What this process should be started with: the libraries to preload (the BLAS with its interposer, then the
    malloc) and the environment that goes with them. Raises ``PreloadError`` for a choice that cannot be had."""
    env: dict[str, str] = {}
    preload: list[str] = []
    if (library := find_blas()) is not None:
        preload, problem = preload_for(library)
        if problem:
            env[GEMV_PROBLEM_ENV] = problem
    if (malloc := find_malloc()) is not None:
        preload.append(malloc)
        if _is_jemalloc(malloc) and MALLOC_CONF_ENV not in os.environ:
            env[MALLOC_CONF_ENV] = JEMALLOC_CONF
    return preload, env


def reexec_with_preloads() -> None:
    """Restart this process with the fast BLAS and the malloc preloaded (``preloads``), once, if there is either
    and no BLAS is loaded yet.

    Call it before anything heavy is imported: ``execv`` replaces the process.
    """
    if not is_linux_cpu_backend() or preloaded_blas() or os.environ.get(REEXEC_GUARD):
        return
    preload, extra = preloads()
    if not preload:
        return
    env = {**os.environ, **extra}
    env[PRELOAD_ENV] = ":".join(filter(None, [*preload, env.get(PRELOAD_ENV)]))
    env[REEXEC_GUARD] = "1"
    reexec(env)


def reexec_early(argv: list[str]) -> None:
    """``reexec_with_preloads`` at once for a command that runs MLX (serve, generate, a worker), before the command
    line is parsed: parsing imports the settings and the logging, which the replaced process would import for
    nothing. A problem (``NEURON_BLAS`` or ``NEURON_MALLOC`` naming nothing usable) is left for the CLI to say once
    the arguments are checked: it meets it again there."""
    if "--worker" in argv or argv[:1] in (["serve"], ["generate"]):
        try:
            reexec_with_preloads()
        except PreloadError:
            pass


def blas_in_use() -> str:
    """Which BLAS serves MLX in this process, and how one-row products go, for the startup log; call it after
    MLX is imported."""
    if sys.platform == "darwin":
        return "Accelerate"
    library = preloaded_blas()
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown (no /proc)"
    if library is None or Path(library).resolve().as_posix() not in maps:
        # numpy's bundled libscipy_openblas64_ may be mapped too: it exports suffixed symbols MLX never calls.
        return "reference BLAS bundled with mlx"
    name = next((lib.name for lib in LIBRARIES if Path(library).name.startswith(_stem(lib))), "cblas")
    rows = "sgemv" if "/native/gemv-" in maps else "sgemm"
    return f"{name} ({Path(library).resolve()}), one-row products by {rows}"


def malloc_in_use() -> str:
    """Which malloc serves this process, for the startup log: a preloaded one that is mapped, else glibc's."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown (no /proc)"
    chosen = os.environ.get(MALLOC_ENV, "")
    for path in filter(None, os.environ.get(PRELOAD_ENV, "").split(":")):
        if (_is_jemalloc(path) or path == chosen) and Path(path).resolve().as_posix() in maps:
            return f"{'jemalloc' if _is_jemalloc(path) else 'preloaded'} ({Path(path).resolve()})"
    return "glibc"


def _is_jemalloc(path: str) -> bool:
    return Path(path).name.startswith("libjemalloc")


def gemv_problem() -> str | None:
    """Why one-row products go through sgemm in this process (no compiler, turned off), if they do."""
    return os.environ.get(GEMV_PROBLEM_ENV)


def allowed_cores() -> list[int]:
    """The cores the calling thread may run on; where the system does not say (macOS), every core."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_cores(cores: list[int], count: int) -> list[list[int]] | None:
    """``count`` contiguous blocks of ``cores``, one per rank on a host; None when there are too few to split."""
    if count < 1 or len(cores) < count:
        return None
    per = len(cores) // count
    return [cores[r * per : (r + 1) * per] for r in range(count)]


def pin(cpus: list[int]) -> None:
    """Confine the calling thread, and every thread it starts from now on, to ``cpus``.

    On Linux affinity is per thread and inherited at creation: pinning before
    MLX starts its BLAS and ring threads pins them too.
    """
    os.sched_setaffinity(0, cpus)


def thread_ids() -> set[int]:
    """This process's threads, by native id (none where the system does not list them)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def place(threads: list[int], cores: list[int]) -> None:
    """Confine each of ``threads`` (native ids) to ``cores``; one that has ended is passed over."""
    for thread in threads:
        try:
            os.sched_setaffinity(thread, cores)
        except OSError:
            pass


def keep_off(thread: int, cores: list[int]) -> set[int] | None:
    """Confine the thread ``thread`` (a native id) to the cores other than ``cores``, where there are any, and return
    the cores it had (None where it was left as it was). For the event loop's thread, off the core a rank alone and
    MLX's stream thread share (``one_core``): a stream's writes and the client they wake then never preempt the
    step's forward (``Rank0Thread.place``)."""
    try:
        had = os.sched_getaffinity(thread)
        others = sorted(had - set(cores))
        if not others:
            return None
        os.sched_setaffinity(thread, others)
    except OSError:
        return None  # the thread has ended
    return had


def restore(thread: int, cores: set[int] | None) -> None:
    """Give ``thread`` back the cores ``keep_off`` took it off (nothing with None)."""
    if cores is None:
        return
    try:
        os.sched_setaffinity(thread, cores)
    except OSError:
        pass  # the thread has ended


def one_core() -> list[int]:
    """A core for a rank alone in its process's group to run its MLX work on, with MLX's own thread beside it.

    Why: MLX's CPU backend hands each operation from the thread that evaluates to its stream's thread, which
    sleeps whenever it runs out of work. Free to float, the two take turns on different cores, and a step's
    hundreds of hand-offs each wake a sleeping thread across cores; on one core each is a context switch. The
    BLAS's own threads, started when the library loaded, keep every core; the event loop's thread is kept off it
    where steps are short (``keep_off``). Pin the calling thread before its first MLX operation: the stream's
    thread is started then, and inherits the mask. The core is the one the calling thread runs on, so that the
    ranks of several servers on one host land where the kernel spread them.
    """
    allowed = sorted(os.sched_getaffinity(0))
    try:  # the "processor" field of /proc/thread-self/stat: the core this thread last ran on
        here = int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return allowed[-1:]
    return [here] if here in allowed else allowed[-1:]


def set_blas_threads(count: int) -> None:
    """Match the preloaded BLAS's thread count to this rank's cores (no-op with the reference BLAS)."""
    library = preloaded_blas()
    if library is None:
        return
    try:
        handle = ctypes.CDLL(library)
    except OSError:
        return
    for symbol in (lib.threads_symbol for lib in LIBRARIES):
        if hasattr(handle, symbol):
            getattr(handle, symbol)(count)


def parse_cpus(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c]
