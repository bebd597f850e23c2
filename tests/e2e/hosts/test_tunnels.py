"""``--data-plane ssh`` with real processes on this host: the look for a listener a tunnel's helper runs before it
adds the forward back, and the tunnels' close naming each connection that had ended. The decisions alone:
tests/unit/launch/test_tunnels.py; across namespaces: tests/e2e/hosts/test_multihost.py."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import anyio
import pytest

from neuron.launch import ssh, tunnels
from neuron.launch.launcher import Launcher
from testkit import wait_until
from testkit.launching import LEADER, MAC2, MAC3


def test_the_look_for_a_listener_finds_one_without_connecting_and_gives_up_on_none() -> None:
    """What a tunnel's helper runs on the rank's host before it adds the forward back (``reopen_when_listening``):
    it must see a listening socket without connecting to it (MLX's ring accepts one connection per address)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        check = tunnels.LISTENING_CHECK.format(port=port, hex=f"{port:04X}", tries=50)
        assert subprocess.run(["sh", "-c", check], timeout=30).returncode == 0
        listener.settimeout(0)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    assert subprocess.run(["sh", "-c", check], timeout=30).returncode == 1  # gone: gives up after its looks


@pytest.mark.skipif(not hasattr(os, "waitid"), reason="no os.waitid here: asyncio's returncode alone")
def test_closing_the_tunnels_names_once_each_connection_that_had_ended_by_itself() -> None:
    """A step can break the group before the tunnels' watch sees an ssh connection end: the recovery's ``close``
    then names it, so the loss is still said, even where asyncio has not yet reported it ended (its child watcher
    reaps on a thread and reports through the event loop, which has not run here); one the watch said already
    (``forget``) is not named twice. Real processes stand in for the ssh connections (tests/e2e/hosts/test_multihost.py
    kills real ones)."""

    async def scenario() -> None:
        opened = tunnels.Tunnels(Launcher([LEADER, MAC2, MAC3]))
        lost, said, open_ = [await anyio.open_process(["sleep", "60"]) for _ in range(3)]
        said.kill()
        await said.wait()
        # Killed as the test bed kills a tunnel's ssh, then the loop blocked on purpose: the watcher's thread reaps
        # it, and the loop has not heard.
        lost.kill()
        wait_until(lambda: not Path(f"/proc/{lost.pid}").exists(), 30, "the watcher to reap the lost process")
        assert lost.returncode is None
        read_end, write_end = os.pipe()
        os.close(write_end)
        relay = ssh.StderrRelay(read_end, 1, MAC2.ssh)
        folder = Path("unused")  # the control sockets' paths: no ssh reads them here
        opened._connections = {"a": (folder, lost, relay), "b": (folder, said, relay), "c": (folder, open_, relay)}
        assert opened.forget(said) and not opened.forget(said)
        assert [(host, process) for host, process, _ in await opened.close()] == [("a", lost)]
        assert open_.returncode is not None and opened.connections() == []  # the open one was ended

    anyio.run(scenario)
