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

import pytest

from neuron.launch.holder import hold_tunnel, release_tunnel
from testkit.server import wait_until

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


def test_a_worker_that_leaves_in_order_takes_its_holder_with_it_and_the_connection_ends() -> None:
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
        worker.stdin.close()  # the leader is gone: the worker leaves in order
        assert worker.wait(10) == 0
        wait_until(lambda: not _alive(holder), 10, "the holder to end with a worker that left in order")
        conn.settimeout(10)
        assert conn.recv(16) == b""  # the end of the connection, no zeros
        conn.close()


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
            with pytest.raises(OSError, match="none of rank 0's 1 connection"):
                hold_tunnel(ssh.pid, [unrelated.fileno()])  # a connection that does not end in the ssh process
            write_end, holder = hold_tunnel(ssh.pid, [conn.fileno()])
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
        write_end, holder = hold_tunnel(ssh.pid, [conn.fileno()])
        release_tunnel(write_end)  # the leader closes its tunnels: ``Tunnels.close``
        wait_until(lambda: holder.poll() is not None, 10, "the holder to end with the tunnel closed in order")
        ssh.kill()
        ssh.wait(10)
        conn.settimeout(10)
        assert conn.recv(16) == b""  # the end of the connection: nothing held it
        conn.close()
