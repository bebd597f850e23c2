"""The Linux CPU fast path: OpenBLAS for every rank, and one block of cores per rank.

Nothing here imports MLX, on purpose: what BLAS a process uses and where its
threads may run must be settled before MLX (and the BLAS it links) is loaded.

Why OpenBLAS: the ``mlx[cpu]`` wheel links the reference BLAS, 1.5-2.6 GFLOP/s
on fp32 matmuls; ``libmlx.so`` imports ``cblas_sgemm`` unversioned, so
preloading OpenBLAS replaces it (prefill about 28x faster on a tiny model).
A library can only be preloaded before a process starts, so the leader
re-executes itself once, and hands the same preload to its workers.

Why pinning: the ring backend's socket threads busy-poll while a transfer is
pending. Two ranks floating over two shared cores starve each other (a small
all-reduce took 7-8 ms); pinned, each to its own core, 50-180 us.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import sys
from pathlib import Path

from neuron.reexec import reexec

PRELOAD_ENV = "LD_PRELOAD"
BLAS_ENV = "NEURON_BLAS"  # "reference" turns the fast path off; a path picks that library
REEXEC_GUARD = "NEURON_REEXECED"


def is_linux_cpu_backend() -> bool:
    """Linux with the CPU build of MLX (a CUDA build does its matmuls on the GPU)."""
    if sys.platform != "linux":
        return False
    try:
        importlib.metadata.distribution("mlx-cuda")
    except importlib.metadata.PackageNotFoundError:
        return True
    return False


def find_openblas() -> str | None:
    """A threaded OpenBLAS on this machine, or None."""
    choice = os.environ.get(BLAS_ENV, "")
    if choice == "reference":
        return None
    if choice:
        return choice if Path(choice).is_file() else None
    arch = platform.machine()
    candidates = [
        f"/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",  # Debian, Ubuntu
        "/usr/lib64/libopenblasp.so.0",  # Fedora, RHEL: the pthreads build
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",  # Arch
    ]
    return next((c for c in candidates if Path(c).is_file()), None)


OPENBLAS_HINT = (
    "MLX is using its bundled reference BLAS, which is slow on CPU: "
    "install OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread; "
    "Fedora: dnf install openblas-threads) for about 25x faster prefill"
)


def preloaded_openblas() -> str | None:
    return next((p for p in os.environ.get(PRELOAD_ENV, "").split(":") if "openblas" in p), None)


def reexec_with_openblas() -> None:
    """Restart this process with OpenBLAS preloaded, once, if it is present and not yet loaded.

    Call it before anything heavy is imported: ``execv`` replaces the process.
    """
    if not is_linux_cpu_backend() or preloaded_openblas() or os.environ.get(REEXEC_GUARD):
        return
    library = find_openblas()
    if library is None:
        return
    env = dict(os.environ)
    env[PRELOAD_ENV] = ":".join(filter(None, [library, env.get(PRELOAD_ENV)]))
    env[REEXEC_GUARD] = "1"
    reexec(env)


def blas_in_use() -> str:
    """Which BLAS this process has loaded, for the startup log; call it after MLX is imported."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown (no /proc)"
    paths = {line.split()[-1] for line in maps.splitlines() if "blas" in line.lower() and "/" in line}
    # Only a libopenblas* can serve MLX's unversioned cblas_sgemm: numpy's bundled
    # libscipy_openblas64_ exports suffixed symbols that MLX never calls.
    openblas = sorted(p for p in paths if Path(p).name.startswith("libopenblas"))
    if openblas:
        return f"OpenBLAS ({openblas[0]})"
    if sys.platform == "darwin":
        return "Accelerate"
    return "reference BLAS bundled with mlx"


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


def set_blas_threads(count: int) -> None:
    """Match OpenBLAS's thread count to this rank's cores (no-op without OpenBLAS)."""
    library = preloaded_openblas()
    if library is None:
        return
    try:
        ctypes.CDLL(library).openblas_set_num_threads(count)
    except (OSError, AttributeError):
        pass


def parse_cpus(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c]
