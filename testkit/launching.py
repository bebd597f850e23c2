"""Hosts as the launch decisions' tests name them: hostfile entries no test reaches, and the handshake a host
answers with (``rpc.HostInfo``), its memory as the test needs it."""

from __future__ import annotations

from neuron import rpc
from neuron.launch.hosts import Host

LEADER, MAC2, MAC3 = Host("localhost"), Host("me@mac2"), Host("me@mac3")


def host_info(free: int, limit: int = 0) -> rpc.HostInfo:
    """mac2's handshake: ``free`` bytes available, under a memory cgroup's ``limit`` where it is not 0."""
    return rpc.HostInfo("mac2", "0.1.0", "0.32.4", "0.32.2", "3.11.7", "linux-x86_64", free, limit, "", -1, [0], 0)
