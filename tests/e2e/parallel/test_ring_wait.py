"""A rank waiting in a collective for a late peer sleeps in the kernel rather than spin a core
(``neuron.system.sockets.calm``, which ``rank.dist.group.join`` applies to a ring's connections).

Real processes and a real MLX ring over loopback, each joined through neuron's ``join``: rank 0 comes to the
all-reduce a second late, and rank 1 says how much CPU its process spent waiting for it. MLX's socket threads spin on
non-blocking sockets; where ranks outnumber cores that spin takes the core the late peer needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from testkit import ROOT
from testkit.system import free_ports

LATE_S = 1.0
RANK = """
import json, resource, sys, time
import mlx.core as mx
from neuron.rank.dist import group

rank, hostfile, late = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
joined, total = group.join(rank, 2, "ring", {"MLX_RANK": str(rank)}, {"MLX_HOSTFILE": hostfile})
assert total == 2.0, total
if rank == 0:
    time.sleep(late)  # the late peer
used = resource.getrusage(resource.RUSAGE_SELF)
started = time.monotonic()
mx.eval(mx.distributed.all_sum(mx.ones(1024), group=joined, stream=mx.cpu))
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime
print(json.dumps({"waited_s": time.monotonic() - started, "cpu_s": cpu}), flush=True)
"""


def test_a_rank_waiting_for_a_late_peer_in_a_collective_spends_almost_no_cpu() -> None:
    hostfile = json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(2)])
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), hostfile, str(LATE_S)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "MLX_WORLD_SIZE": "2"},
        )
        for rank in range(2)
    ]
    said = [process.communicate(timeout=120) for process in ranks]
    for process, (_, err) in zip(ranks, said, strict=True):
        assert process.returncode == 0, err[-3000:]
    waiting = json.loads(said[1][0])
    assert waiting["waited_s"] >= LATE_S / 2, waiting  # it did wait for rank 0
    # Spinning, its socket thread would have spent most of the wait on a core.
    assert waiting["cpu_s"] < LATE_S / 4, waiting
