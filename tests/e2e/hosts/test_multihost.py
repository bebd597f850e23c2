"""Ranks on other hosts: namespaces on this machine, each a "host" with its own sshd (testkit/testbed.py).

The same leader drives workers over SSH, the ring crosses the namespaces' links,
and everything the local path promises holds: equal tokens, refusals that name
the host, faults under which every stream goes on with no operator, and
nothing left running on any host.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from neuron import log
from neuron.system import device
from testkit import (
    Server,
    alive,
    faults,
    make_tiny_model,
    resume,
    run_neuron,
    run_neuron_side_by_side,
    serving,
    tcp_sockets,
    wait_until,
)
from testkit.server import PARIS
from testkit.system import FakeSystemd, Journal
from testkit.testbed import Namespaces, children, unavailable

pytestmark = [pytest.mark.hosts, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")]

PROMPT = "hello"
GREEDY = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0}


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaces]:
    testbed = Namespaces(3, tmp_path_factory.mktemp("testbed"))
    try:
        yield testbed.start()
    finally:
        testbed.close()


def hosts_args(bed: Namespaces, hostfile: Path) -> tuple[str, ...]:
    return ("--hosts", str(hostfile), "--ssh-command", bed.ssh_command)


def nothing_left(bed: Namespaces, hosts: tuple[int, ...] = (0, 1, 2), timeout: float = 10) -> None:
    wait_until(lambda: not any(bed.workers(i) for i in hosts), timeout, f"no neuron worker left on hosts {hosts}")


def generate(*args: str) -> str:
    done = run_neuron("generate", "--max-tokens", "24", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_tp2_across_two_hosts_equals_tp1(
    bed: Namespaces, tiny_models: dict[str, Path], tiny_alone: Callable[[str], str]
) -> None:
    """The llama; the qwen3 is held to its one-rank text below, its log read from the journal."""
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(0)], "tp2-llama.json")
    assert generate("--model", str(tiny_models["llama"]), *hosts_args(bed, hostfile), PROMPT) == tiny_alone("llama")
    nothing_left(bed)


def test_pipeline_stages_across_hosts_equal_tp1(
    bed: Namespaces, tiny_models: dict[str, Path], tiny_alone: Callable[[str], str]
) -> None:
    """Each host holds its own run of layers; the hidden states cross the link, the last back to the leader. (A
    middle stage, its states in from one host and out to another: SmolLM2's three stages below.)"""
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(0)], "pp2.json")
    staged = generate("--model", str(tiny_models["qwen3"]), "--pp", "2", *hosts_args(bed, hostfile), PROMPT)
    assert staged == tiny_alone("qwen3")
    nothing_left(bed)


def test_qwen3_tp2_across_two_hosts_equals_tp1_and_the_remote_workers_log_reaches_the_journal(
    bed: Namespaces, tiny_models: dict[str, Path], tiny_alone: Callable[[str], str], tmp_path: Path
) -> None:
    """The qwen3's tokens across two hosts are its tokens on one rank; and ``journalctl -u neuron HOST=mac2``: the
    leader relays each remote line as a journal entry of its own."""
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(0)], "tp2-qwen3.json")
    with Journal(tmp_path / "journal") as journal:
        done = run_neuron(
            "generate", "--model", str(tiny_models["qwen3"]), "--max-tokens", "24", *hosts_args(bed, hostfile),
            "--log-format", "journal", "--log-level", "info", PROMPT, env={log.JOURNAL_SOCKET_ENV: str(journal.path)},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout == tiny_alone("qwen3")
        wait_until(lambda: journal.entries(EVENT="share loaded", RANK="1"), 10, "the remote shard's journal entry")
    entry = journal.one(EVENT="share loaded", RANK="1")
    assert entry["HOST"] == f"root@{bed.ip(0)}" and entry["PRIORITY"] == "6"
    assert journal.entries(EVENT="worker started", HOST=f"root@{bed.ip(0)}")


def test_tp3_across_three_hosts_equals_tp1(bed: Namespaces, tmp_path: Path) -> None:
    """Every all-reduce around a ring of three hosts: a tiny qwen3 whose heads and MLP split in three. (SmolLM2's
    nine heads split in three on one host in tests/e2e/caching/test_prefix_cache.py; each host converts it itself in
    the next test.)
    SmolLM2 here took minutes: three ranks on two cores wait on each other at every all-reduce of its thirty
    layers, token after token. So two layers and twelve tokens: each all-reduce of a step is made at every token,
    and a wrong sum changes the first. The one-rank reference runs beside it: both are mostly start-ups."""
    model = str(make_tiny_model(tmp_path / "qwen3-thirds", "qwen3", layers=2, heads=6, intermediate=768))
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(0), bed.entry(1)], "tp3.json")
    run = ("generate", "--max-tokens", "12", "--model", model)
    spread, alone = run_neuron_side_by_side((*run, *hosts_args(bed, hostfile), PROMPT), (*run, PROMPT))
    for done in (spread, alone):
        assert done.returncode == 0, done.stderr[-3000:]
    assert spread.stdout == alone.stdout
    nothing_left(bed)


def test_smollm2_in_three_stages_across_three_hosts_equals_tp1(
    bed: Namespaces, smollm2_paris: subprocess.CompletedProcess[str]
) -> None:
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(0), bed.entry(1)], "pp3-smollm2.json")
    # No --model: each host finds the embedded SmolLM2 and converts it itself. One rank's answer: conftest's.
    staged = run_neuron("generate", *hosts_args(bed, hostfile), "--pp", "3", *PARIS)  # 30 layers in three stages
    assert staged.returncode == 0, staged.stderr[-3000:]
    assert staged.stdout == smollm2_paris.stdout and "Paris" in staged.stdout
    nothing_left(bed)


@pytest.fixture(scope="module")
def cluster(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A server whose rank 1 is on host 0, with a short step deadline for the link-down fault."""
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(0)], "cluster.json")
    args = ("--model", str(tiny_models["qwen3"]), "--step-timeout", "3", *hosts_args(bed, hostfile))
    with serving(tmp_path_factory, *args) as server:
        yield server
    nothing_left(bed)


@pytest.fixture(scope="module")
def reference(tiny_alone: Callable[[str], str]) -> str:
    """GREEDY's completion on one rank: what ``neuron generate`` prints, less the newline it ends with (the same
    tokens; tests/e2e/hosts/test_push.py holds a server to it too)."""
    return tiny_alone("qwen3").removesuffix("\n")


def complete(server: Server) -> str:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "qwen3", **GREEDY}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_the_data_plane_binds_only_the_named_addresses_and_workers_log_their_host(
    bed: Namespaces, cluster: Server, reference: str
) -> None:
    assert complete(cluster) == reference
    (worker,) = bed.workers(0)
    allowed = {bed.leader_ip, bed.ip(0), "127.0.0.1"}
    for pid in (cluster.process.pid, worker):
        sockets = tcp_sockets(pid)
        assert sockets and all(address in allowed for address, _, _ in sockets), (pid, sockets)
    ring = [s for s in tcp_sockets(worker) if s[0] == bed.ip(0)]
    assert ring, "the remote worker holds no socket on its host's address"
    host = f"root@{bed.ip(0)}"
    assert cluster.find_log("share loaded", rank=1, host=host) is not None  # relayed from host 0's worker
    metrics = cluster.metrics()
    assert metrics[("neuron_rank_info", (("host", host), ("rank", "1")))] == 1


def _ss(*args: str, namespace: str | None = None) -> list[tuple[str, int, str, int, str]]:
    """(local address, port, peer address, port, process) of each TCP socket ``ss -Htnp ARGS`` lists, in
    ``namespace`` (this one by default)."""
    inside = ["ip", "netns", "exec", namespace] if namespace else []
    lines = subprocess.run([*inside, "ss", "-Htnp", *args], capture_output=True, text=True, check=True).stdout
    out = []
    for fields in (line.split() for line in lines.splitlines()):
        process = fields.pop() if fields[-1].startswith("users:") else ""
        (ip, _, port), (peer, _, peer_port) = fields[-2].rpartition(":"), fields[-1].rpartition(":")
        out.append((ip.strip("[]"), int(port), peer.strip("[]"), int(peer_port) if peer_port != "*" else 0, process))
    return out


def _restarts(server: Server) -> float:
    return server.metrics().get(("neuron_worker_restarts_total", ()), 0.0)


RESUMING = resume.shorter(120)  # the four resume requests: long enough that a fault lands mid-stream


@pytest.fixture(scope="module")
def undisturbed(cluster: Server) -> list[str]:
    """What the four resume requests give on the cluster before any fault."""
    return resume.references(cluster.url, RESUMING)


def test_a_cut_ssh_session_and_every_stream_goes_on(bed: Namespaces, cluster: Server, undisturbed: list[str]) -> None:
    (ssh,) = children(cluster.process.pid, "ssh")
    (old,) = bed.workers(0)
    before = _restarts(cluster)
    resume.disturb(cluster, undisturbed, resume.kill(ssh, signal.SIGKILL), bases=RESUMING)
    resumed = [e for e in cluster.logs() if e.get("event") == "resumed"]
    assert resumed and all(e["rank"] == 1 and e["host"] == f"root@{bed.ip(0)}" for e in resumed), resumed
    assert _restarts(cluster) == before + 1 and cluster.find_log("restarting") is None
    wait_until(lambda: not alive(old), 15, "the cut session's worker to exit on its host")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])  # noticed by the process watch, or the deadline
def test_a_remote_worker_killed_or_stopped_and_every_stream_goes_on(
    bed: Namespaces, cluster: Server, undisturbed: list[str], sig: signal.Signals
) -> None:
    (worker,) = bed.workers(0)
    before = _restarts(cluster)
    try:
        resume.disturb(cluster, undisturbed, resume.kill(worker, sig), bases=RESUMING)
    finally:
        if sig == signal.SIGSTOP:
            with contextlib.suppress(ProcessLookupError):  # its SSH session is gone: it exits once it runs again
                os.kill(worker, signal.SIGCONT)
    assert _restarts(cluster) == before + 1
    wait_until(lambda: not alive(worker), 15, "the lost worker to be gone from its host")


def test_a_link_down_mid_step_and_every_stream_goes_on_once_it_is_back(
    bed: Namespaces, cluster: Server, undisturbed: list[str]
) -> None:
    """The step deadline fires, rank 0 is freed from its collective (its connections cut), and recovery tries the
    host until it answers again, within --resume-timeout: the streams wait, then go on."""
    (old,) = bed.workers(0)
    before = _restarts(cluster)
    host = f"root@{bed.ip(0)}"

    def tries() -> int:
        return len([e for e in cluster.logs() if e.get("event") == "recovery failed; trying again"])

    def link_down_until_a_try_fails() -> None:
        failed_before = tries()
        bed.link(0, up=False)
        try:
            wait_until(lambda: tries() > failed_before, 90, f"a try to reach {host} failing")
            response = httpx.get(f"{cluster.url}/ready", timeout=10)
            assert response.status_code == 503 and host in response.text, response.text
        finally:
            bed.link(0, up=True)

    resume.disturb(cluster, undisturbed, link_down_until_a_try_fails, bases=RESUMING)
    # Once back, a step may miss its deadline again beside the stranded worker, which spins inside the lost group
    # until its host's TCP notices the cut (seconds after the link is back): recovered again, in this process.
    assert _restarts(cluster) >= before + 1 and cluster.find_log("restarting") is None
    wait_until(lambda: not alive(old), 30, "the stranded worker to exit once its link is back")


@pytest.fixture(scope="class")
def ssh_plane(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """``--data-plane ssh`` with rank 1 on host 1, for the class below; ended with it, before the refusals that
    need host 1 empty."""
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(1)], "ssh-plane.json")
    args = ("--model", str(tiny_models["qwen3"]), "--data-plane", "ssh", "--step-timeout", "30")
    with serving(tmp_path_factory, *args, *hosts_args(bed, hostfile)) as server:
        yield server
    # No tunnel left once the server is gone.
    nothing_left(bed, (1,))
    wait_until(lambda: not bed.pids(1), 10, "no session (worker or tunnel) left on host 1")


class TestTheSshDataPlane:
    """One server over the SSH data plane: first what it listens on and what crosses the bridge, then the faults it
    must resume through."""

    def test_the_ssh_data_plane_listens_on_loopback_and_crosses_the_bridge_only_inside_ssh(
        self, bed: Namespaces, ssh_plane: Server, reference: str
    ) -> None:
        """The same tokens as TP=1; every ring listener on its host's loopback, the tunnels' ends too; between the
        hosts nothing but SSH (port 22)."""
        server = ssh_plane
        assert complete(server) == reference
        assert server.find_log("ssh tunnels open", links=["0->1", "1->0"]) is not None
        (worker,) = bed.workers(1)
        # On host 1: loopback only, but for the test bed's own sshd on its address (its config names it).
        host = bed.namespaces[1]
        for ip, port, _, _, process in _ss("-l", namespace=host):
            assert ip == "127.0.0.1" or ((ip, port) == (bed.ip(1), 22) and "sshd" in process), (ip, port, process)
        connected = _ss("state", "established", namespace=host)
        crossing = [s for s in connected if s[0] == bed.ip(1)]
        assert crossing and all(port == 22 for _, port, _, _, _ in crossing), crossing
        ring = [s for s in connected if f"pid={worker}," in s[4]]
        assert ring and all(ip == peer == "127.0.0.1" for ip, _, peer, _, _ in ring), ring  # to sshd's tunnel ends
        # On the leader's host: its own sockets and its ssh processes' (the workers' and the tunnel's).
        leader = [server.process.pid, *children(server.process.pid, "ssh")]
        for pid in leader:
            for ip, port, state in tcp_sockets(pid):
                assert ip == "127.0.0.1" or (ip == bed.leader_ip and state == "ESTABLISHED"), (pid, ip, port, state)
        mine = [s for s in _ss("state", "established") if any(f"pid={pid}," in s[4] for pid in leader)]
        peers = {(ip, port) for _, _, ip, port, _ in mine}
        assert peers and all(port == 22 for ip, port in peers if ip == bed.ip(1)), peers
        assert len(children(server.process.pid, "ssh")) == 2  # the worker's session and the tunnels'
        # Behind rank 0's links, in the tunnels' ssh, a holder: a tunnel killed leaves them open (``launch.holder``).
        holders = [p for p in children(server.process.pid) if b"closed by the peer" in _cmdline(p)]
        assert len(holders) == 1 and server.find_log("ssh tunnel not held") is None, holders

    def test_over_the_ssh_data_plane_a_killed_tunnel_or_session_and_every_stream_goes_on(
        self, bed: Namespaces, ssh_plane: Server, undisturbed: list[str]
    ) -> None:
        """The tunnel connection killed is a lost link, noticed at once (``ssh tunnel lost``, no step deadline),
        and the streams resume in this process over fresh tunnels; then the worker's own session cut, and they
        resume again. Each stream ends as on the cluster over the plain ring: the same split gives the same tokens
        whichever plane carries its collectives (what the first test above checks of one greedy request), so the
        references are the module's, not this slower server's own."""
        server = ssh_plane
        restarts = _restarts(server)

        def session(tunnel: bool) -> int:
            (pid,) = [p for p in children(server.process.pid, "ssh") if (b"ControlMaster=yes" in _cmdline(p)) == tunnel]
            return pid

        resume.disturb(server, undisturbed, resume.kill(session(tunnel=True), signal.SIGKILL), bases=RESUMING)
        # Said by the tunnel's watch whichever broke the group first: the watch itself (op liveness) or the step
        # whose ring connection the tunnel carried (op generate_step, "connection to a peer was lost").
        lost = server.find_log("ssh tunnel lost")
        why = str(lost and lost["status"])
        assert f"the SSH connection carrying the data plane's tunnels to root@{bed.ip(1)}" in why, lost
        assert "was killed by SIGKILL" in why, lost
        broken = [str(e["failures"]) for e in server.logs() if e.get("event") == "pool broken"]
        assert broken and not any("deadline" in b or "stuck" in b for b in broken), broken  # no deadline needed
        resume.disturb(server, undisturbed, resume.kill(session(tunnel=False), signal.SIGKILL), bases=RESUMING)
        assert _restarts(server) == restarts + 2 and server.find_log("restarting") is None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# Refusals: each answered within REFUSED_S, naming the rank and the host, with nothing left running anywhere.
# They use hosts 1 and 2: host 0 serves the cluster above until the module ends.
# The bound is under the 31 s a rank that joined the ring would wait for a peer that never comes: a refusal comes
# from the handshake, before any join. What it leaves is two interpreters' start-ups (the leader's, and a worker's
# over SSH), which this 2-core machine's load stretched past 10 s (at a load of 15 to 19).
REFUSED_S = 25


def _refused(bed: Namespaces, tmp_path: Path, hostfile: Path, model: Path, *expected: str) -> str:
    server = Server("--model", str(model), *hosts_args(bed, hostfile), log_path=tmp_path / "refused.log")
    started = time.monotonic()
    try:
        assert server.process.wait(timeout=REFUSED_S) == 1, server.stderr()[-3000:]
    finally:
        server.stop()
    assert time.monotonic() - started < REFUSED_S
    for words in expected:
        assert words in server.stderr(), server.stderr()[-3000:]
    last = server.stderr().strip().splitlines()[-1]
    assert last.startswith("neuron: error: ") and "Traceback" not in server.stderr(), server.stderr()[-3000:]
    nothing_left(bed, (1, 2))
    return server.stderr()


def test_a_host_running_another_mlx_is_refused(bed: Namespaces, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    liar = {**bed.entry(1), "neuron": bed.neuron_command({faults.FAKE_HOST_ENV: "mlx=0.0.1"}, faults.ENTRY)}
    hostfile = bed.hostfile([bed.entry(-1), liar], "liar.json")
    _refused(bed, tmp_path, hostfile, tiny_models["qwen3"], f"rank 1 on root@{bed.ip(1)}", "runs mlx 0.0.1")


def test_a_host_holding_another_model_is_refused(bed: Namespaces, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    original = tiny_models["qwen3"]
    copy = tmp_path / "qwen3-changed"
    shutil.copytree(original, copy)
    # One tensor's values changed in place: same names, shapes, dtypes and offsets, so the same header and size.
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header_length = int.from_bytes(data[:8], "little")
    tensors = json.loads(data[8 : 8 + header_length])
    name = sorted(k for k in tensors if k.endswith("mlp.down_proj.weight"))[0]
    begin = 8 + header_length + tensors[name]["data_offsets"][0]
    data[begin : begin + 64] = bytes(64)
    weights.write_bytes(bytes(data))
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(1, model=str(copy))], "other-model.json")
    _refused(bed, tmp_path, hostfile, original, f"rank 1 on root@{bed.ip(1)}", "has a different model.safetensors")


def test_a_host_missing_the_model_is_refused(bed: Namespaces, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    hostfile = bed.hostfile([bed.entry(-1), bed.entry(1, model="/nowhere/qwen3")], "missing.json")
    _refused(bed, tmp_path, hostfile, tiny_models["qwen3"], f"rank 1 on root@{bed.ip(1)}", "/nowhere/qwen3")


def _waiting(
    bed: Namespaces, tmp_path: Path, hostfile: Path, model: Path, *expected: str, env: dict[str, str] | None = None
) -> Server:
    """A server that cannot reach a host: within REFUSED_S it says so in its log and on /ready, with no worker
    left."""
    server = Server("--model", str(model), *hosts_args(bed, hostfile), log_path=tmp_path / "waiting.log", env=env)
    try:
        entry = server.wait_log("host unreachable; trying again", timeout=REFUSED_S)
        for words in expected:
            assert words in entry["error"], entry
        server.port = server.wait_log("listening")["port"]
        ready = httpx.get(f"{server.url}/ready", timeout=5)
        assert ready.status_code == 503 and "waiting for" in ready.text, ready.text
        nothing_left(bed, (1, 2), 5)
    except BaseException:
        server.stop()
        raise
    return server


def test_nccl_gives_each_rank_a_gpu_of_its_host_and_refuses_a_host_short_of_them(
    bed: Namespaces, tiny_models: dict[str, Path]
) -> None:
    """Two pipeline stages on one remote host, its GPU count faked in its handshake. One GPU: refused before
    anything loads, naming the host, its count and the ranks. Two: each rank starts with its own GPU, set on the
    SSH command line, and this CPU build of MLX (no nccl) fails the join on every rank in neuron's words, which
    name the GPU each was given."""
    host = f"root@{bed.ip(1)}"

    def run(gpus: int) -> str:
        remote = {**bed.entry(1), "neuron": bed.neuron_command({faults.FAKE_HOST_ENV: f"gpus={gpus}"}, faults.ENTRY)}
        hostfile = bed.hostfile([bed.entry(-1), remote, remote], f"nccl-{gpus}.json")
        model = ("--model", str(tiny_models["qwen3"]), "--pp", "3", "--backend", "nccl", "--max-tokens", "2")
        done = run_neuron(
            "generate",
            *model,
            *hosts_args(bed, hostfile),
            PROMPT,
            env={faults.FAKE_HOST_ENV: "gpus=1"},
            module=faults.ENTRY,
        )
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        nothing_left(bed, (1, 2))
        return done.stderr.strip().splitlines()[-1]

    short = run(1)
    assert f"{host} (" in short and "has 1 GPU (as its driver lists them), but ranks 1, 2 are placed on it" in short
    if device.backend() == "cuda":
        return  # nccl would start here: the join's failure is for a build without it
    failed = run(2)
    for rank, gpu in ((1, 0), (2, 1)):
        assert re.search(rf"rank {rank} on {host}: [\w: ]*could not join the nccl group", failed), failed
        assert f"it was given CUDA_VISIBLE_DEVICES={gpu};" in failed.split(f"rank {rank} on {host}")[1], failed


def test_an_unreachable_ring_address_is_named_before_any_rank_joins(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    hidden = f"10.{bed.net}.9.2"  # on host 1, but no route leads there
    ns = bed.namespaces[1]
    os.system(f"ip netns exec {ns} ip addr add {hidden}/32 dev lo")
    try:
        hostfile = bed.hostfile([bed.entry(-1), {**bed.entry(1), "ips": [hidden]}], "hidden.json")
        server = _waiting(bed, tmp_path, hostfile, tiny_models["qwen3"], "cannot reach rank 1", hidden)
        assert server.stop() == 0
    finally:
        os.system(f"ip netns exec {ns} ip addr del {hidden}/32 dev lo")


def test_a_host_whose_sshd_is_down_is_named_then_served_once_it_is_back(
    bed: Namespaces, tiny_models: dict[str, Path], tmp_path: Path, reference: str
) -> None:
    host = f"root@{bed.ip(2)}"
    bed.stop_sshd(2)
    with FakeSystemd(tmp_path / "notify") as systemd:
        try:
            hostfile = bed.hostfile([bed.entry(-1), bed.entry(2)], "sshd-down.json")
            env = {"NOTIFY_SOCKET": str(systemd.path)}
            server = _waiting(bed, tmp_path, hostfile, tiny_models["qwen3"], host, "Connection refused", env=env)
        finally:
            bed.start_sshd(2)
        try:
            wait_until(lambda: server.find_log("recovered") is not None, 60, "serving once sshd is back")
            assert complete(server) == reference
            # STATUS= said whom it waited for, then names the hosts it serves from.
            serving = f"ready: qwen3 on 2 rank(s) (localhost, {host})"
            wait_until(lambda: any(s.startswith(serving) for s in systemd.statuses()), 5, f"STATUS={serving}")
            assert any(status.startswith(f"waiting for {host}") for status in systemd.statuses())
        finally:
            assert server.stop() == 0
    nothing_left(bed, (1, 2))


def test_the_hostfile_is_checked_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    for content, message in (
        ('[{"ssh": "mac2", "ips": ["10.0.0.2"]}]', "entry 0 of the hostfile is the leader's own host"),
        ('[{"ssh": "localhost", "ips": ["10.0.0.1"]}, {"ssh": "mac2"}]', "has no 'ips'"),
        ('[{"ssh": "localhost", "ips": ["not-an-ip"]}]', "is not an IP address"),
        ('[{"ssh": "localhost", "port": 3}]', "unknown keys ['port']"),
        ("{", "not valid JSON"),
    ):
        bad.write_text(content)
        done = run_neuron("serve", "--hosts", str(bad), "--port", "0", timeout=30)
        assert done.returncode == 2 and message in done.stderr, (content, done.stderr)
    bad.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 2))
    done = run_neuron("serve", "--hosts", str(bad), "--tp", "3", "--port", "0", timeout=30)
    assert done.returncode == 2 and "names 2 ranks, but --tp 3 x --pp 1 makes 3" in done.stderr
