"""MLX's remaining limit, standalone: on the ring backend, a collective queued after a socket's thread has ended
waits forever. Each socket's thread fails its pending transfers after ten errors and returns (mlx PR 4060, from
0.32.2); a later transfer on that socket is queued with nobody to serve it. neuron works around it (docs/recovery.md:
the stand-in and the holders keep rank 0's sockets served); this test turns green the day MLX fixes it."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from testkit.system import free_ports

# One rank of a two-process ring over loopback. Rank 1 leaves once the group works; rank 0, told the peer is gone,
# runs collectives one after another and says how each ended.
RANK = """
import os, sys
import mlx.core as mx

group = mx.distributed.init(backend="ring", strict=True)
mx.eval(mx.distributed.all_sum(mx.ones(4), stream=mx.cpu))
print("joined", flush=True)
if group.rank() == 1:
    os._exit(0)
sys.stdin.readline()
for attempt in range(int(sys.argv[1])):
    try:
        mx.eval(mx.distributed.all_sum(mx.ones(1 << 16), stream=mx.cpu))
        print(attempt, "returned", flush=True)
    except RuntimeError as e:
        print(attempt, "failed", e, flush=True)
"""
JOIN_S = 60  # two interpreters importing MLX on a shared CPU
ANSWER_S = 10  # a collective on a lost peer fails within a second or two; one that waits forever does not
# How many send errors one failed collective costs depends on the machine and its timing, so the
# test runs enough collectives that a socket's thread passes its ten errors wherever it runs.
ATTEMPTS = 30
# Now and then, on a loaded machine, every collective of a pair ends all the same (seen in CI and in the multi-host
# loop): the limit is a race, so a pair that shows no stuck collective is tried again
# before the test says MLX has fixed it.
TRIALS = 3


def _lines(process: subprocess.Popen[str]) -> queue.Queue[str]:
    """The process's stdout, line by line, read on a thread so that a wait has a deadline."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line.strip())

    threading.Thread(target=read, daemon=True).start()
    return lines


@pytest.mark.xfail(strict=True, reason="MLX ring: a transfer queued after its socket's thread ended waits forever")
def test_every_collective_after_a_lost_peer_ends(tmp_path: Path) -> None:
    for trial in range(TRIALS):
        if (stuck := _stuck_collective(tmp_path / f"trial{trial}")) is not None:
            pytest.fail(f"collective {stuck} after the peer was lost did not end within {ANSWER_S} s")


def _stuck_collective(folder: Path) -> int | None:
    """One survivor's collectives after its peer left: the first that did not end, or None where all ended."""
    folder.mkdir()
    hostfile = folder / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(2)]))
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(RANK), str(ATTEMPTS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # MLX's "[ring] ..." lines
            text=True,
            env={**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)},
        )
        for rank in range(2)
    ]
    try:
        survivor, peer = ranks
        said = _lines(survivor)
        assert said.get(timeout=JOIN_S) == "joined"
        assert peer.wait(timeout=JOIN_S) == 0  # the peer is gone, its sockets closed
        assert survivor.stdin is not None
        survivor.stdin.write("go\n")
        survivor.stdin.flush()
        for attempt in range(ATTEMPTS):
            try:
                answer = said.get(timeout=ANSWER_S)
            except queue.Empty:
                return attempt
            assert answer.startswith(f"{attempt} "), answer
        return None
    finally:
        for process in ranks:
            process.kill()
            process.wait(timeout=10)
