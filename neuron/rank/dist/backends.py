"""Forgetting MLX's distributed group, so that this process can join a fresh one.

Why this exists: ``mx.distributed.init`` caches one group per backend per
process and hands the cached one back on every later call, dead peers and all.
MLX's library exports ``clear_backends()``, which empties that cache, but its
Python module does not bind it; so it is called here through ``ctypes``. The
leader calls it on rank 0's thread once a group is lost and every reference to
the old group (the model's sharded layers hold it) is dropped, and then joins a
fresh group with fresh workers, keeping its process, and so its open streams.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.metadata
import sys
from pathlib import Path

import mlx.core as mx

# Whether a thread of this process was left inside a lost group's collective (``Pool.recover``): its MLX stream
# never finishes, and anything that waits for every stream would wait with it.
_wedged_stream = False

# mlx::core::distributed::clear_backends(), as the Itanium C++ ABI (Linux, macOS) names it.
CLEAR_BACKENDS = "_ZN3mlx4core11distributed14clear_backendsEv"


class NoClearBackends(RuntimeError):
    """This MLX cannot forget its group: a lost group then needs a fresh process."""


def library() -> Path:
    """MLX's shared library, as installed beside ``mlx.core``."""
    name = "libmlx.dylib" if sys.platform == "darwin" else "libmlx.so"
    return Path(mx.__file__).resolve().parent / "lib" / name


def clear_backends() -> None:
    """Empty MLX's cache of distributed groups, so that the next ``mx.distributed.init`` forms a new group.

    The caller must have dropped every reference to the old group first: one
    still held keeps the old group's connections open (never used again). Raises
    ``NoClearBackends`` naming the library and the symbol when this MLX does not
    export it (MLX before 0.30, or a build without it).
    """
    path = library()
    try:
        clear = getattr(ctypes.CDLL(str(path)), CLEAR_BACKENDS)
    except (OSError, AttributeError) as e:
        raise NoClearBackends(
            f"MLX {importlib.metadata.version('mlx')} ({path}) does not export {CLEAR_BACKENDS} "
            f"(mlx::core::distributed::clear_backends): a lost group cannot be replaced in this process ({e})"
        ) from e
    gc.collect()  # groups held only by cycles (a traceback's frames) go before the cache lets them go
    clear.restype = None
    clear()


def stream_left_wedged() -> None:
    """A thread of this process is left inside MLX for good (a collective of a lost group, ``Pool.recover``)."""
    global _wedged_stream
    _wedged_stream = True


def evaluates() -> None:
    """Evaluate one sum on this thread's stream: what a thread started beside one left wedged cannot do where MLX's
    scheduler, which counts every stream's queued work, has every evaluation wait for one of the wedged ones."""
    mx.eval(mx.array(1.0) + 1)


def thread_ends() -> None:
    """Forget this thread's MLX state (``mx.clear_streams``: its streams and its default random key) while it can
    still take the GIL: call it last on any thread, other than the main one, that ran MLX and then ends.

    Why: a thread's random key (made by any ``mx.random`` call without a key, as mlx-lm's layers' initializers
    are) is a C++ thread-local whose destructor takes the GIL, and it runs after ``Thread.join`` has returned.
    When the process is exiting by then, Python ends the thread inside that destructor, and the C++ runtime
    aborts the whole process ("terminate called without an active exception", SIGABRT) after its work was done.
    MLX's own ``atexit`` clears the main thread's key only."""
    mx.clear_streams()


def clear_cache() -> None:
    """Give MLX's cached buffers back to the system (``mx.clear_cache``), unless a thread was left wedged inside
    MLX: ``clear_cache`` first waits for every CPU stream, and a wedged thread's stream never finishes. The cache
    is then kept, and reused."""
    if not _wedged_stream:
        mx.clear_cache()
