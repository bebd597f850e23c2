"""A worker's ring connections outlive it, answered with zeros, until the peer lets go (``neuron.launch.holder``).

Real processes and a real TCP connection: a stand-in worker connects to this test's listener, hands its connection to
a holder, and is SIGKILLed; the test's end must then read zeros where it would have read the end of the connection.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

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
