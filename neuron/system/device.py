"""What MLX computes on here: the CPU, an NVIDIA GPU through CUDA, or Metal; settled before MLX loads.

The answer picks the machinery. The Linux CPU fast path (``cpu.py``: a BLAS
preloaded by re-executing, the sgemv interposer, ranks pinned to cores) serves
the CPU build alone: a GPU does its products itself, and what a rank can give a
model is its GPU's memory, not the host's.

Why from the installed distributions rather than from MLX: the fast path must be
settled before MLX, and the library it links, is loaded. On Linux, MLX's builds
are distributions of their own beside ``mlx`` (``pip install "mlx[cpu]"``,
``"mlx[cuda12]"``, ``"mlx[cuda13]"``): ``mlx-cpu``, ``mlx-cuda-12``,
``mlx-cuda-13`` (``mlx-cuda`` is an old release's name). Each ships
``mlx/lib/libmlx.so``, so where two are installed, the one installed last has
replaced the other's library; its size, against each distribution's record,
says which one MLX will load. On macOS MLX computes on Metal.

No MLX is imported here at module level; the functions that need it say so.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import re
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Literal

Backend = Literal["cpu", "cuda", "metal"]

LIBRARY = "mlx/lib/libmlx.so"
INSTALL_HINT = (
    "install one MLX build with neuron: pip install 'neuron[cpu]' on a CPU, 'neuron[cuda13]' or 'neuron[cuda12]' "
    "on an NVIDIA GPU (by the CUDA version its driver supports, as nvidia-smi shows)"
)


def backend_for(platform: str, builds: Collection[str]) -> Backend:
    """The device MLX computes on, from ``sys.platform`` and the MLX builds whose library is installed
    (``mlx-cpu``, ``mlx-cuda-12``, ...; ``library_owners`` settles which where several are)."""
    if platform == "darwin":
        return "metal"
    if any(build.startswith("mlx-cuda") for build in builds):
        return "cuda"
    return "cpu"


def is_build(name: str) -> bool:
    """A distribution that ships MLX's library for one device (not ``mlx`` itself, nor ``mlx-lm``)."""
    return name in ("mlx-cpu", "mlx-metal") or name.startswith("mlx-cuda")


def library_owners(recorded: Mapping[str, int | None], on_disk: int | None) -> list[str]:
    """Of the builds installed (each with the size its record gives ``libmlx.so``, None where it records none),
    those whose library is the one on disk; all of them where that cannot be told."""
    if len(recorded) < 2 or on_disk is None:
        return sorted(recorded)
    owners = [name for name, size in recorded.items() if size == on_disk]
    return sorted(owners or recorded)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_builds() -> list[str]:
    """The MLX builds installed for this interpreter whose library MLX will load (package metadata only)."""
    recorded: dict[str, int | None] = {}
    on_disk: int | None = None
    for dist in importlib.metadata.distributions():
        # The name from the folder's (no METADATA parsed: reading every distribution's would take a third of a
        # second at every start), else from METADATA.
        name = _canonical(getattr(dist, "_normalized_name", None) or dist.metadata["Name"] or "")
        if not is_build(name) or name in recorded:
            continue  # the same distribution seen again further down sys.path is shadowed by the first
        entry = next((f for f in dist.files or () if f.as_posix() == LIBRARY), None)
        recorded[name] = entry.size if entry is not None else None
        if entry is not None and on_disk is None:
            try:
                on_disk = Path(str(dist.locate_file(entry))).stat().st_size
            except OSError:
                pass
    return library_owners(recorded, on_disk)


@functools.cache
def backend() -> Backend:
    """This process's device (cached: the installed builds do not change under a running process)."""
    return backend_for(sys.platform, installed_builds())


def cannot_load(error: ImportError) -> str:
    """What to do when MLX fails to import: most often, on Linux, ``mlx`` installed without a build."""
    if sys.platform == "linux" and not installed_builds():
        return f"MLX has no build installed for this machine (mlx-cpu, mlx-cuda-12 or mlx-cuda-13): {INSTALL_HINT}"
    return f"MLX cannot be loaded ({error}); {INSTALL_HINT}"


def gpu_count() -> int:
    """The NVIDIA GPUs this host's driver lists (0 without one), whatever ``CUDA_VISIBLE_DEVICES`` says: a
    worker's own variable names the one GPU it was given, and the leader needs the host's count."""
    listed = Path("/proc/driver/nvidia/gpus")
    try:
        return sum(1 for _ in listed.iterdir())
    except OSError:
        pass
    try:
        return sum(1 for node in Path("/dev").iterdir() if re.fullmatch(r"nvidia\d+", node.name))
    except OSError:
        return 0


def gpu_memory_of(info: Mapping[str, str | int], active: int = 0, cached: int = 0) -> tuple[int, int] | None:
    """What a rank may still take on the GPU ``mx.device_info`` describes, and the most it may hold in all; None if
    it says neither. CUDA: the free memory (NVML's, every process counted) and the buffers MLX holds freed for
    reuse (``cached``), of the card's total; Metal: the recommended working set (what its allocator keeps to),
    less what MLX holds (``active``)."""
    if "free_memory" in info:
        total = int(info.get("total_memory", info.get("memory_size", 0)))
        return int(info["free_memory"]) + cached, total
    if "max_recommended_working_set_size" in info:
        total = int(info["max_recommended_working_set_size"])
        return max(0, total - active), total
    return None


def gpu_memory() -> tuple[int, int] | None:
    """This rank's GPU's room and total (``gpu_memory_of``), or None on the CPU backend. Imports MLX: call it only
    on a GPU backend, where nothing needs to be settled before MLX loads, or once MLX is loaded."""
    if backend() == "cpu":
        return None
    try:
        import mlx.core as mx

        return gpu_memory_of(mx.device_info(mx.gpu), mx.get_active_memory(), mx.get_cache_memory())
    except Exception:  # noqa: BLE001 - a rank given a GPU its host lacks must still answer the handshake, whose
        return None  # GPU count then refuses the host in neuron's words


# How MLX's allocators say an allocation failed: Metal's and CUDA's own words, and the driver's (cudaMalloc's "out
# of memory", a Metal command buffer's "Insufficient Memory").
_OUT_OF_MEMORY = re.compile(
    r"unable to allocate|out of memory|insufficient memory|outofmemory|maximum allowed buffer size|resource limit \(",
    re.IGNORECASE,
)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is MLX failing to allocate on the device (not the group or the model failing)."""
    return isinstance(error, (RuntimeError, MemoryError)) and (
        isinstance(error, MemoryError) or _OUT_OF_MEMORY.search(str(error)) is not None
    )


# glibc's malloc raises its mmap threshold each time it frees a large block (up to 32 MiB), and blocks under that
# size then come from the heap, which it seldom gives back: a process's memory stays at a burst's high mark. A
# fixed threshold keeps every large block (a KV cache's arrays, a step's activations) in a mapping of its own,
# unmapped when freed, so that a rank's memory (and its cgroup's) says what it really holds.
M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
MMAP_THRESHOLD = 128 << 10  # glibc's own starting threshold, kept


def return_freed_memory() -> None:
    """Have this process's C library give freed large blocks back at once (glibc; elsewhere nothing changes)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def used_memory() -> int:
    """Bytes this process holds: MLX's active memory on a GPU (its buffers, which the resident set does not count
    on CUDA), else the process's resident set (weights, caches and all). Imports MLX on a GPU backend only."""
    if backend() != "cpu":
        try:
            import mlx.core as mx

            return int(mx.get_active_memory())
        except Exception:  # noqa: BLE001 - a reading the page shows must never fail a step
            return 0
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _gib(size: int | str | None) -> str:
    return f"{int(size or 0) / (1 << 30):.1f} GiB"


def describe_device(kind: Backend, info: Mapping[str, str | int]) -> str:
    """The startup log's name for a rank's device: the GPU's model and memory, Metal's, or the CPU (whose BLAS
    the log's ``blas`` names beside it)."""
    name = info.get("device_name") or info.get("architecture") or "unknown"
    if kind == "cuda":
        total = info.get("total_memory", info.get("memory_size"))
        return f"CUDA GPU {name} ({_gib(total)}, {_gib(info.get('free_memory'))} free)"
    if kind == "metal":
        budget = info.get("max_recommended_working_set_size")
        return f"Metal GPU {name} ({_gib(info.get('memory_size'))}, {_gib(budget)} for the GPU)"
    return f"CPU {name} ({info.get('architecture', 'unknown')})"


def this_device() -> str:
    """``describe_device`` for this process; call it once MLX is loaded."""
    import mlx.core as mx

    kind = backend()
    try:
        info = mx.device_info(mx.cpu if kind == "cpu" else mx.gpu)
    except Exception as e:  # noqa: BLE001 - the log line must not be what stops the start; unusable_gpu says why
        return f"{kind}, not described by MLX ({e})"
    return describe_device(kind, info)


def unusable_gpu() -> str | None:
    """Why MLX for CUDA cannot compute here (it sees no GPU), if so; call it once MLX is loaded."""
    if backend() != "cuda":
        return None
    import mlx.core as mx

    if mx.device_count(mx.gpu) > 0:
        return None
    return (
        "MLX for CUDA sees no GPU: check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES, and that the build matches "
        f"the driver's CUDA version; or {INSTALL_HINT}"
    )
