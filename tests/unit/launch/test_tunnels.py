"""``--data-plane ssh``, the decisions: which tunnels each ring link needs, each rank's own hostfile, the ssh
command lines, what a failed forward means and the probe through a tunnel's end (real sockets on loopback). No ssh,
no model, no process; tests/e2e/hosts/test_tunnels.py runs the look for a listener and the tunnels' close with
real processes, and tests/e2e/hosts/test_multihost.py runs the tunnels across namespaces."""

from __future__ import annotations

import itertools
import json
import socket
import threading
from pathlib import Path

import pytest

from neuron.config import sources
from neuron.launch import dataplane, ssh
from neuron.launch.checks import Refused, Unreachable
from neuron.launch.hosts import Host, HostsError, check_hosts
from neuron.launch.launcher import Launcher
from neuron.launch.tunnels import Forward, Link, forward_failure, plan_links, ring_view
from testkit.launching import LEADER, MAC2, MAC3


def ports(start: int = 50000) -> itertools.count:
    return itertools.count(start)


def listening(world_size: int) -> list[str]:
    return [f"127.0.0.1:{4000 + rank}" for rank in range(world_size)]


def test_two_hosts_take_a_local_and_a_remote_forward_on_the_remote_hosts_connection() -> None:
    links = plan_links([LEADER, MAC2], listening(2), ports().__next__)
    assert links == [
        # rank 0 reaches rank 1 through a listener on the leader's loopback, forwarded to mac2's
        Link(0, 1, None, (Forward(1, "-L", 50000, "127.0.0.1:4001"),)),
        # rank 1 reaches rank 0 through a listener sshd opens on mac2's loopback (port 0: sshd picks it)
        Link(1, 0, None, (Forward(1, "-R", 0, "127.0.0.1:4000"),)),
    ]
    assert links[0].forwards[0].spec == "127.0.0.1:50000:127.0.0.1:4001"
    assert links[1].forwards[0].spec == "127.0.0.1:0:127.0.0.1:4000"


def test_ranks_on_one_machine_connect_directly_and_two_remote_hosts_relay_through_the_leader() -> None:
    hosts = [LEADER, LEADER, MAC2, MAC2, MAC3]
    links = plan_links(hosts, listening(5), ports().__next__)
    assert links[0] == Link(0, 1, "127.0.0.1:4001")  # both on the leader's machine: no tunnel
    assert links[1] == Link(1, 2, None, (Forward(2, "-L", 50000, "127.0.0.1:4002"),))
    assert links[2] == Link(2, 3, "127.0.0.1:4003")  # both on mac2
    # mac2 to mac3: the leader holds the only credentials, so the link is relayed through its loopback
    assert links[3] == Link(
        3, 4, None, (Forward(4, "-L", 50001, "127.0.0.1:4004"), Forward(3, "-R", 0, "127.0.0.1:50001"))
    )
    assert links[4] == Link(4, 0, None, (Forward(4, "-R", 0, "127.0.0.1:4000"),))
    assert plan_links([LEADER], listening(1), ports().__next__) == []


def test_each_rank_gets_a_hostfile_of_its_own_where_only_its_next_ranks_entry_differs() -> None:
    """MLX's ring reads entry r (to accept) and entry r + 1 (to connect); the others are never used."""
    addresses, entries = listening(3), ["127.0.0.1:50000", "127.0.0.1:38000", "127.0.0.1:39000"]
    views = [ring_view(rank, addresses, entries) for rank in range(3)]
    assert views[0] == [["127.0.0.1:4000"], ["127.0.0.1:50000"], ["127.0.0.1:4002"]]
    assert views[1] == [["127.0.0.1:4000"], ["127.0.0.1:4001"], ["127.0.0.1:38000"]]
    assert views[2] == [["127.0.0.1:39000"], ["127.0.0.1:4001"], ["127.0.0.1:4002"]]
    # The probe connects where the ring will: the next rank's entry in the prober's own view.
    assert [dataplane.probe_targets("ring", r, views[r]) for r in range(3)] == [[e] for e in entries]
    env, files = dataplane.backend_setup("ring", 2, views[2], [LEADER, MAC2, MAC3])
    assert json.loads(files["MLX_HOSTFILE"]) == views[2] and env["MLX_RANK"] == "2"


def test_the_ssh_command_lines_for_a_tunnel_connection_and_its_forwards(tmp_path: Path) -> None:
    control = tmp_path / "ssh-0"
    argv = ssh.tunnel_argv(["ssh", "-F", "cfg"], "me@mac2", control)
    assert argv[:3] == ["ssh", "-F", "cfg"] and "BatchMode=yes" in argv and f"ControlPath={control}" in argv
    assert "ControlMaster=yes" in argv and argv[-2:] == ["me@mac2", ssh.TUNNEL_SESSION]
    assert argv.index("--") == len(argv) - 3  # a host name never read as an option
    forward = ssh.forward_argv(["ssh"], control, "me@mac2", "-R", "127.0.0.1:0:127.0.0.1:4000")
    assert forward == [
        "ssh", "-o", "BatchMode=yes", "-S", str(control), "-O", "forward", "-R", "127.0.0.1:0:127.0.0.1:4000", "--",
        "me@mac2",
    ]  # fmt: skip
    cancel = ssh.forward_argv(["ssh"], control, "me@mac2", "-L", "127.0.0.1:50000:127.0.0.1:4001", "cancel")
    assert cancel[cancel.index("-O") : cancel.index("-O") + 4] == [
        "-O",
        "cancel",
        "-L",
        "127.0.0.1:50000:127.0.0.1:4001",
    ]


def test_only_the_ring_is_tunnelled_and_it_needs_no_ips_then() -> None:
    hosts = [Host("localhost"), Host("me@mac2")]  # no "ips": the ring listens on each host's loopback
    check_hosts(hosts, "ring", "ssh")
    with pytest.raises(HostsError, match="has no 'ips'"):
        check_hosts(hosts, "ring", "direct")
    with pytest.raises(HostsError, match="--data-plane ssh tunnels the ring's TCP links; jaccl"):
        check_hosts([Host("localhost", ("10.0.0.1",), (None, "a")), Host("me@mac2", ("10.0.0.2",), ("b", None))],
                    "jaccl", "ssh")  # fmt: skip
    assert Launcher([LEADER, MAC2], data_plane="ssh").tunnelled
    assert not Launcher([LEADER, LEADER], data_plane="ssh").tunnelled and not Launcher([LEADER, MAC2]).tunnelled
    setting = sources.SETTINGS["data_plane"]
    assert setting.default == "direct" and setting.parse("ssh", "--data-plane") == ("ssh", None)
    assert setting.parse("tls", "NEURON_DATA_PLANE")[1] == "NEURON_DATA_PLANE must be one of direct, ssh, got 'tls'"


def test_a_probe_through_a_tunnel_whose_far_end_is_gone_is_named() -> None:
    """Through a tunnel, ssh accepts the connect itself and closes it when nothing listens behind: only the
    listener's greeting tells the two apart."""
    with socket.create_server(("127.0.0.1", 0)) as tunnel_end:
        address = dataplane.join_address("127.0.0.1", tunnel_end.getsockname()[1])

        def accept_and_close() -> None:
            conn, _ = tunnel_end.accept()
            conn.close()

        closer = threading.Thread(target=accept_and_close)
        closer.start()
        unreachable = dataplane.probe([address], timeout=5)
        closer.join()
    assert "closed before any listener answered" in unreachable[address]
    listeners = dataplane.Listeners()
    try:
        (greeting,) = listeners.open(["127.0.0.1"])
        assert dataplane.probe([greeting, greeting]) == {}  # each connection is greeted
    finally:
        listeners.close()


def test_a_failed_forward_names_the_link_and_what_to_do() -> None:
    hosts = ["localhost", "me@mac2", "me@mac3"]
    relay = Link(1, 2, None, (Forward(2, "-L", 50001, "127.0.0.1:4002"), Forward(1, "-R", 0, "127.0.0.1:50001")))
    taken = forward_failure(relay.forwards[0], relay, hosts, "Port forwarding failed")
    assert isinstance(taken, Unreachable) and taken.hosts == ["me@mac3"]  # the leader tries again, other ports
    assert str(taken).startswith("the SSH tunnel from rank 1 on me@mac2 to rank 2 on me@mac3: cannot listen on ")
    assert "the leader's 127.0.0.1:50001 through me@mac3's SSH connection (ssh: Port forwarding failed)" in str(taken)
    refused = forward_failure(relay.forwards[1], relay, hosts, "remote port forwarding failed for listen port 0")
    assert isinstance(refused, Refused)  # an operator must change sshd_config: trying again cannot help
    assert "sshd on me@mac2 would not listen on its 127.0.0.1" in str(refused)
    assert "AllowTcpForwarding" in str(refused) and "--data-plane direct" in str(refused)
    gone = forward_failure(relay.forwards[1], relay, hosts, "Control socket connect(/tmp/x): No such file or directory")
    assert isinstance(gone, Unreachable) and gone.hosts == ["me@mac2"]  # the connection died: not sshd's refusal
