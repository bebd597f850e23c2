"""A worker's ring connections, held open and answered once the worker is gone, so that no peer waits on them forever.

Why: MLX's ring gives each socket a thread that, after ten failed transfers in a
row, fails what is pending on it and ends. A collective queued on that socket
afterwards (the rest of a step rank 0 had already built) waits forever, with
rank 0's thread, and through MLX's scheduler, which counts every stream's queued
work, every other thread of the leader (``pool.replacement``'s
``Replacement._abandon_rank0``). A worker that dies closes its sockets, and its
peers see that within microseconds: sooner than the leader can put its stand-in
(``dataplane.Sink``) under its own ends.

So a worker, once in a ring, hands copies of its connections to a tiny process
of its own, the holder. While the worker lives the holder only waits. The moment
the worker is gone (killed, crashed, out of memory) its copies keep the
connections open, and it reads and drops every byte its peers send and sends
zeros, so every collective they have queued completes, with values nobody reads
(the leader breaks the pool on the loss), and their threads come out. It ends
when every peer has closed its end (they left the group, or the leader's sink
took their ends over) or ``HOLD_S`` after the worker, and at once where the
worker leaves in order (``release``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess

from neuron.launch.dataplane import group_sockets
from neuron.launch.watchdog import companion

# Seconds a holder keeps answering after its worker is gone: past the leader's leaving a lost group, which it does
# within seconds of noticing the loss.
HOLD_S = 60.0

# The holder's program: argv: the pipe's read end (a byte when the worker leaves in order, EOF when it is gone),
# ``HOLD_S``, then the connections' descriptors. Standard library only (it runs with ``-S``), and none of the words a
# process listing looks for to find workers.
HOLDER = """
import os, select, socket, sys, time
life, most = int(sys.argv[1]), float(sys.argv[2])
ends = [socket.socket(fileno=int(fd)) for fd in sys.argv[3:]]
select.select([life], [], [])
if os.read(life, 1):
    sys.exit(0)  # the worker left in order: nobody waits on its connections
for end in ends:
    end.setblocking(False)
zeros = bytes(1 << 16)
deadline = time.monotonic() + most
while ends and time.monotonic() < deadline:
    readable, writable, _ = select.select(ends, ends, [], 0.5)
    for end in set(readable) | set(writable):
        try:
            if end in readable and not end.recv(1 << 16):
                raise ConnectionError("closed by the peer")
            if end in writable:
                end.send(zeros)
        except BlockingIOError:
            continue
        except OSError:
            ends.remove(end)
            end.close()
"""


def hold(hostfile: str) -> int:
    """Start this worker's holder on its connections to the ring ``hostfile`` (the ring's addresses, JSON, as this
    rank sees them); how many it holds. None is started where the worker has none (a group of one)."""
    fds = group_sockets(json.loads(hostfile), connected=True)
    if not fds:
        return 0
    write_end, holder = companion(HOLDER, str(HOLD_S), *map(str, fds), pass_fds=tuple(fds))
    _keep[write_end] = holder
    return len(fds)


def release() -> None:
    """This worker leaves in order (its leader said so, or is gone): its holder ends without answering for it."""
    for write_end in _keep:
        with contextlib.suppress(OSError):
            os.write(write_end, b"x")


_keep: dict[int, subprocess.Popen[bytes]] = {}  # the pipe's write end, open for the life of this process
