"""What ends a worker whose leader is gone, wherever the worker is: between requests, inside a collective, or
inside ``mx.distributed.init``.

A worker waiting on stdin reads EOF the moment its leader (or the leader's SSH
session) is gone, and leaves. One busy inside MLX does not: a collective for a
peer that never answers, or the ring's ``init``, whose accept has no timeout and
which holds the GIL, so that no thread of the worker's own can even run. Over
SSH it is not re-parented either, so ``PR_SET_PDEATHSIG`` cannot help there.
What changes in every case is its stdin: a pipe whose writer closed reports a
hang-up without a byte being read. So a sentinel, a tiny process of its own that
needs no GIL of the worker's, shares the worker's stdin and waits for that
hang-up; it then gives the worker ``GRACE_S`` to leave by itself (an idle worker
reads the EOF and exits cleanly), and kills it. It ends with the worker: it
holds the read end of a pipe whose only writer is the worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

# Seconds a worker whose leader is gone gets to leave by itself before its sentinel kills it.
GRACE_S = 1.0

# The sentinel's program: stdin is the worker's; argv: the pipe's read end (``companion``), the worker's pid, the grace
# in seconds.
# Kept free of imports beyond the standard library's smallest (it runs with ``-S``), and of the words a process
# listing looks for to find workers.
SENTINEL = """
import os, select, signal, sys
life, worker, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
gone = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
poller = select.poll()
poller.register(0, gone)
poller.register(life, gone | select.POLLIN)
while True:
    events = dict(poller.poll())
    if life in events:
        sys.exit(0)
    if events.get(0, 0) & gone:
        poller.unregister(0)
        if not poller.poll(grace * 1000):
            os.kill(worker, signal.SIGKILL)
        sys.exit(0)
"""


def start_sentinel(grace: float = GRACE_S) -> subprocess.Popen[bytes] | None:
    """Start this worker's sentinel on its stdin (fd 0); None where there is no stdin pipe to watch (a worker run
    by hand on a terminal) or no ``poll`` (not Linux or macOS)."""
    import select

    if not hasattr(select, "poll") or os.isatty(0):
        return None
    # stdin inherited: the stdin it watches
    write_end, sentinel = companion(SENTINEL, str(os.getpid()), str(grace), stdin=None)
    _keep[write_end] = sentinel
    return sentinel


def companion(
    program: str, *args: str, pass_fds: tuple[int, ...] = (), stdin: int | None = subprocess.DEVNULL
) -> tuple[int, subprocess.Popen[bytes]]:
    """Start ``program`` beside this worker (``python -S -c``, reaped by a thread of its own), with the read end of
    a pipe whose only writer is this process as its first argument, then ``args``: the pipe's write end and the
    process. The caller keeps the write end open for its life: its exit is the companion's end of file. Never the
    protocol's stdout, nor stderr: they must close with the worker."""
    read_end, write_end = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-S", "-c", program, str(read_end), *args],
            stdin=stdin,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(read_end, *pass_fds),
        )
    finally:
        os.close(read_end)
    threading.Thread(target=child.wait, name="neuron-companion-reaper", daemon=True).start()
    return write_end, child


_keep: dict[int, subprocess.Popen[bytes]] = {}  # the pipe's write end, open for the life of this process
