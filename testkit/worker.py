"""A real worker process (``neuron --worker``), driven over its pipes as the leader drives one."""

from __future__ import annotations

import select
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from neuron import rpc
from testkit.server import ROOT, neuron_command


class WorkerProcess:
    def __init__(self, rank: int = 1, world_size: int = 2) -> None:
        self.proc = subprocess.Popen(
            neuron_command("--worker", "--rank", str(rank), "--world-size", str(world_size)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
            bufsize=0,  # unbuffered: reply() selects on the pipe, and a buffered reader would hide a second line
        )

    def send(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def reply(self, timeout: float = 30.0) -> rpc.Reply:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no reply within {timeout} s"
        line = self.proc.stdout.readline()
        assert line, "worker closed its stdout"
        return rpc.decode_reply(line)  # raises on anything that is not a protocol line

    def request(self, message: rpc.Request) -> rpc.Reply:
        self.send(rpc.encode(message))
        return self.reply()


@contextmanager
def spawned_worker() -> Iterator[WorkerProcess]:
    w = WorkerProcess()
    try:
        yield w
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait()
