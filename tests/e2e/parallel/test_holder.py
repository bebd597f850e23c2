"""A worker's ring connections outlive it, answered with zeros, until the peer lets go; and rank 0's links through
a killed ssh tunnel outlive it, unanswered (``neuron.launch.holder``).

Real processes and a real TCP connection: a stand-in worker (or ssh) connects to this test's listener, its end is
handed to a holder, and it is SIGKILLed; the test's end must then read zeros (or nothing) where it would have read
the end of the connection.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron import rpc
from neuron.launch.holder import hold_tunnel, release_tunnel
from testkit import ROOT
from testkit.server import wait_until
from testkit.testbed import children
from testkit.worker import WorkerProcess

WORKER = """
import json, sys
from neuron.launch.holder import _keep, hold
sock = __import__("socket").create_connection(("127.0.0.1", int(sys.argv[1])))
held = hold(json.dumps([[f"127.0.0.1:{sys.argv[1]}"], [f"127.0.0.1:{sock.getsockname()[1]}"]]))
print(json.dumps({"held": held, "holder": [p.pid for p in _keep.values()]}), flush=True)
sys.stdin.read()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_a_dead_workers_connection_stays_open_and_answers_zeros_until_the_peer_closes_it() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            conn, _ = listener.accept()
            assert worker.stdout is not None
            said = json.loads(worker.stdout.readline())
            assert said["held"] == 1, said
            (holder,) = said["holder"]
            conn.sendall(b"x" * 1000)  # while the worker lives, the holder leaves its connection alone
            worker.kill()
            worker.wait(10)
            conn.settimeout(10)
            received = conn.recv(1 << 16)
            assert received and set(received) == {0}, received[:16]  # zeros, not the end of the connection
            conn.sendall(bytes(1 << 20))  # what it sends is read and dropped: a megabyte does not block
            conn.close()
            wait_until(lambda: not _alive(holder), 10, "the holder to end once its peer closed the connection")
        finally:
            if worker.poll() is None:
                worker.send_signal(signal.SIGKILL)
                worker.wait(10)


def test_a_worker_told_to_leave_takes_its_holder_with_it_and_the_connection_ends() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        leaving = WORKER.replace(
            "sys.stdin.read()", "sys.stdin.read()\nfrom neuron.launch.holder import release\nrelease()"
        )
        worker = subprocess.Popen(
            [sys.executable, "-c", leaving, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        conn, _ = listener.accept()
        assert worker.stdin is not None and worker.stdout is not None
        (holder,) = json.loads(worker.stdout.readline())["holder"]
        worker.stdin.close()  # the stand-in's cue: its leader said shutdown
        assert worker.wait(10) == 0
        wait_until(lambda: not _alive(holder), 10, "the holder to end with a worker that left in order")
        conn.settimeout(10)
        assert conn.recv(16) == b""  # the end of the connection, no zeros
        conn.close()


# Rank 0 of a two-rank ring beside a real ``neuron --worker``: once joined, each line on its stdin asks how its ring
# connections stand: "open" (nothing to read), "data" (something was sent), or "closed".
RANK0 = """
import json, os, socket, sys
import mlx.core as mx
from neuron.system.sockets import group_sockets
mx.distributed.init(backend="ring", strict=True)
mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # the worker's sanity all-reduce
fds = group_sockets(json.loads(open(os.environ["MLX_HOSTFILE"]).read()), connected=True)
print(len(fds), flush=True)
for _ in sys.stdin:
    states = []
    for fd in fds:
        with socket.socket(fileno=os.dup(fd)) as end:
            try:
                states.append("closed" if end.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"" else "data")
            except BlockingIOError:
                states.append("open")
            except OSError:
                states.append("closed")
    print(" ".join(states), flush=True)
"""


def _ring(tmp_path: Path) -> tuple[subprocess.Popen[str], WorkerProcess, dict[str, str]]:
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ring = [[f"127.0.0.1:{a.getsockname()[1]}"], [f"127.0.0.1:{b.getsockname()[1]}"]]
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps(ring))
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": "0", "MLX_WORLD_SIZE": "2"}
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK0], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    worker = WorkerProcess()
    settings = rpc.WorkerSettings(host="localhost", log_level="info", log_format="json", cpus=[])
    init = rpc.Init(
        id=1,
        backend="ring",
        env={"MLX_RANK": "1", "MLX_WORLD_SIZE": "2"},
        files={"MLX_HOSTFILE": json.dumps(ring)},
        settings=settings,
    )
    return rank0, worker, init


def test_a_real_worker_whose_pipe_closes_leaves_its_ring_connections_held_open_and_unanswered(tmp_path: Path) -> None:
    """A worker's pipe to its leader that closes may be an SSH session cut under a leader that lives on, its rank 0
    still in the group and perhaps inside a step: the worker leaves, and its holder keeps rank 0's connections
    open, answering nothing (zeros could end a step the worker never finished), until rank 0 lets go."""
    rank0, worker, init = _ring(tmp_path)
    try:
        assert rank0.stdin is not None and rank0.stdout is not None and worker.proc.stdin is not None
        reply = worker.request(init)
        assert isinstance(reply, rpc.InitOk) and reply.all_sum == 2, reply
        assert int(rank0.stdout.readline()) == 2
        (holder,) = [p for p in children(worker.proc.pid) if _holds(p)]
        worker.proc.stdin.close()  # the session is cut: the worker's stdin ends
        assert worker.proc.wait(30) == 0

        def states() -> str:
            rank0.stdin.write("?\n")
            rank0.stdin.flush()
            return rank0.stdout.readline().strip()

        # Open, and a second later still (a released holder ends within milliseconds, closing them; one answering
        # would have sent zeros).
        held = time.monotonic() + 1.0
        while time.monotonic() < held:
            assert states() == "open open"
        assert _alive(holder)
        rank0.stdin.close()  # rank 0 leaves: the holder ends
        rank0.wait(30)
        wait_until(lambda: not _alive(holder), 10, "the holder to end once rank 0 let go")
    finally:
        for process in (rank0, worker.proc):
            if process.poll() is None:
                process.kill()
                process.wait(10)


def _holds(pid: int) -> bool:
    try:
        return b"closed by the peer" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# A stand-in for the leader's ssh: it connects to this test's listener, as ssh's ``-R`` forward connects to rank
# 0's, and says how many bytes it read from the connection once its stdin closes.
SSH = """
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print(sock.getsockname()[1], flush=True)
sys.stdin.readline()
sock.settimeout(10)
got = 0
while got < 1000:
    got += len(sock.recv(1 << 16))
print(got, flush=True)
sys.stdin.read()
"""


def _tunnel(listener: socket.socket) -> tuple[subprocess.Popen[str], socket.socket]:
    ssh = subprocess.Popen(
        [sys.executable, "-c", SSH, str(listener.getsockname()[1])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    conn, _ = listener.accept()
    assert ssh.stdout is not None
    assert int(ssh.stdout.readline()) == conn.getpeername()[1]
    return ssh, conn


def test_a_killed_tunnels_end_of_rank_0s_connection_stays_open_unanswered_until_rank_0_lets_go() -> None:
    """The leader's side of ``--data-plane ssh`` (``hold_tunnel``): the holder takes copies of the ssh process's
    ends and, once ssh is gone, keeps them open, reading what rank 0 sends and answering nothing: rank 0's
    transfers wait, as on a stopped peer, for the leader's stand-in, rather than fail."""
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_server(("127.0.0.1", 0)) as other:
        ssh, conn = _tunnel(listener)
        unrelated = socket.create_connection(other.getsockname())
        try:
            assert hold_tunnel(ssh.pid, [unrelated.fileno()]) is None  # nothing of rank 0's ends in that ssh
            held = hold_tunnel(ssh.pid, [conn.fileno()])
            assert held is not None
            write_end, holder = held
            assert ssh.stdin is not None and ssh.stdout is not None
            conn.sendall(b"x" * 1000)  # while ssh lives, the holder leaves its connection alone
            ssh.stdin.write("go\n")
            ssh.stdin.flush()
            assert int(ssh.stdout.readline()) == 1000
            ssh.kill()
            ssh.wait(10)
            conn.sendall(bytes(1 << 20))  # read and dropped: a megabyte does not block
            conn.settimeout(0.5)
            with pytest.raises(TimeoutError):
                conn.recv(16)  # neither the end of the connection nor any answer
            conn.close()
            wait_until(lambda: holder.poll() is not None, 10, "the holder to end once rank 0 closed its end")
            release_tunnel(write_end)
        finally:
            unrelated.close()
            if ssh.poll() is None:
                ssh.kill()
                ssh.wait(10)


def test_a_tunnel_closed_in_order_takes_its_holder_with_it_and_the_connection_ends() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ssh, conn = _tunnel(listener)
        held = hold_tunnel(ssh.pid, [conn.fileno()])
        assert held is not None
        write_end, holder = held
        release_tunnel(write_end)  # the leader closes its tunnels: ``Tunnels.close``
        wait_until(lambda: holder.poll() is not None, 10, "the holder to end with the tunnel closed in order")
        ssh.kill()
        ssh.wait(10)
        conn.settimeout(10)
        assert conn.recv(16) == b""  # the end of the connection: nothing held it
        conn.close()
