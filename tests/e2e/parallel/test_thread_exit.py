"""A process whose thread ran MLX exits cleanly, however late that thread's end comes against the interpreter's.

A thread's MLX random key is a C++ thread-local whose destructor takes the GIL, after ``Thread.join`` has returned:
where the interpreter is finalizing by then, Python ends the thread inside that destructor and the C++ runtime aborts
the process ("terminate called without an active exception", SIGABRT) after its work was done. Rank 0's thread
(``pool.rank0``) ends with ``rank.dist.backends.thread_ends`` against it. Without that call the bare race below aborted
about one exit in four on two busy cores, so a run of them catches it coming back.
"""

from __future__ import annotations

import subprocess
import sys

EXITS = 16

# A thread that makes its default random key (as a model's initializers do), then ends as rank 0's thread does, and
# the process exits the moment it is joined: the narrowest window there is.
CHILD = """
import threading
import mlx.core as mx
from neuron.rank.dist.backends import thread_ends

def run() -> None:
    try:
        mx.eval(mx.random.uniform(shape=(4,)))
    finally:
        thread_ends()

thread = threading.Thread(target=run, daemon=True)
thread.start()
thread.join()
"""


def test_a_thread_that_made_an_mlx_random_key_never_aborts_the_exit() -> None:
    failures = []
    for _ in range(EXITS):
        done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            failures.append(f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
    assert not failures, f"{len(failures)} of {EXITS} exits failed: {failures}"
