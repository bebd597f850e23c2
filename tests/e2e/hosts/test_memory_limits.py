"""A model larger than any one host: each test host's processes under a memory limit smaller than the weights.

One memory cgroup per host (testkit/cgroups.py): the leader's host is the
leader's own process (rank 0 runs inside it), started in its cgroup; a namespace
host's sshd is moved into its cgroup, so its worker starts there. Split over two
such hosts, tensor-parallel or in pipeline stages, the model serves; on one host
alone it is refused before anything loads, naming the host and the memory it
needed; a host whose handshake cannot tell (here, one that lies) is killed by the
kernel's OOM killer partway through its load, and the leader says so. Never a
hang, nor an abort (a worker lost while rank 0 loads). Each rank's peak memory is
printed (``pytest -s`` or ``-rP`` shows it).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from neuron.models.folder import weight_bytes
from testkit import Server, cgroups, faults, make_tiny_model, wait_until
from testkit.adapters import make_adapter
from testkit.testbed import Namespaces, unavailable

pytestmark = [
    pytest.mark.hosts,
    pytest.mark.skipif(bool(unavailable()), reason=unavailable() or ""),
    pytest.mark.skipif(bool(cgroups.unavailable()), reason=cgroups.unavailable() or ""),
]

LIMIT = 1 << 30  # each host's; a rank's process holds about 200 MiB besides its weights (MLX, BLAS buffers)
SMALL = 512 << 20  # host 1's, less than a rank's half of the weights
LAYERS = 28  # of 51 MiB each at hidden 1024 and intermediate 4096 in fp32: 1.40 GiB in all
LEADER = -1


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("big") / "big", "llama", hidden=1024, layers=LAYERS, intermediate=4096
    )


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespaces]:
    testbed = Namespaces(2, tmp_path_factory.mktemp("testbed"))
    try:
        yield testbed.start()
    finally:
        testbed.close()


@pytest.fixture(scope="module")
def limits(bed: Namespaces) -> Iterator[dict[int, cgroups.MemoryLimit]]:
    """Each host's memory cgroup: the leader's, host 0's at ``LIMIT``, host 1's at ``SMALL``; removed after."""
    made: dict[int, cgroups.MemoryLimit] = {}
    try:
        for host, limit in ((LEADER, LIMIT), (0, LIMIT), (1, SMALL)):
            made[host] = cgroups.MemoryLimit(f"{bed.prefix}m{host + 1}", limit)
            if host >= 0:
                made[host].add(bed.sshd_pid(host))
        yield made
    finally:
        for limit in made.values():
            limit.close()  # kills what is left inside: the hosts' sshd (the bed stops them next), a stray leader


def weights(model: Path) -> int:
    per_layer, rest = weight_bytes(model, LAYERS)
    return sum(per_layer) + rest


def start(bed: Namespaces, limits: dict[int, cgroups.MemoryLimit], tmp_path: Path, *args: str) -> Server:
    """A server whose leader starts in the leader's host's cgroup."""
    return Server(
        *args, "--ssh-command", bed.ssh_command, log_path=tmp_path / "serve.log", cgroup_procs=limits[LEADER].procs
    )


def peak_rss(pid: int, field: str = "VmHWM") -> int:
    """The process's peak resident memory (``VmHWM``), or another of its figures, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


def rss(pid: int) -> int:
    return peak_rss(pid, "VmRSS")


def mib(count: int | None) -> str:
    return "unknown" if count is None else f"{count / (1 << 20):.0f} MiB"


def ended(server: Server, within: float) -> str:
    """The server's last line, once it exited 1 within ``within`` seconds: neuron's own error, no traceback."""
    started = time.monotonic()
    try:
        assert server.process.wait(timeout=within) == 1, server.stderr()[-3000:]
    finally:
        server.stop()
    assert time.monotonic() - started < within
    last = server.stderr().strip().splitlines()[-1]
    assert last.startswith("neuron: error: ") and "Traceback" not in server.stderr(), server.stderr()[-3000:]
    return last


def nothing_left(bed: Namespaces) -> None:
    wait_until(lambda: not bed.workers(0) and not bed.workers(1), 15, "no worker left on either host")


def test_two_limited_hosts_serve_a_model_neither_can_hold(
    bed: Namespaces, limits: dict[int, cgroups.MemoryLimit], big_model: Path, tmp_path: Path
) -> None:
    """TP=2 and PP=2 over the leader's host and host 0, each under 1 GiB, serve 1.40 GiB of weights, and agree."""
    assert weights(big_model) > LIMIT * 1.3
    hostfile = bed.hostfile([bed.entry(LEADER), bed.entry(0)], "two.json")
    texts = {}
    for split in (("--tp", "2"), ("--pp", "2")):
        for limit in limits.values():
            limit.reset_peak()
        server = start(bed, limits, tmp_path, "--model", str(big_model), "--hosts", str(hostfile), *split)
        try:
            server.port = server.wait_log("serving", timeout=240)["port"]
            body = {"model": big_model.name, "prompt": "hello", "max_tokens": 8, "temperature": 0.0}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=240)
            assert response.status_code == 200, response.text
            texts[split] = response.json()["choices"][0]["text"]
            (worker,) = bed.workers(0)
            peaks = {"rank 0": peak_rss(server.process.pid), "rank 1": peak_rss(worker)}
            groups = {"leader's host": limits[LEADER].peak(), "host 0": limits[0].peak()}
        finally:
            assert server.stop() == 0, server.stderr()[-3000:]
        print(
            f"{' '.join(split)}: weights {mib(weights(big_model))}, limit {mib(LIMIT)} per host; peak RSS "
            + ", ".join(f"{rank} {mib(v)}" for rank, v in peaks.items())
            + "; cgroup peak (page cache included) "
            + ", ".join(f"{host} {mib(v)}" for host, v in groups.items())
        )
        assert all(peak < LIMIT for peak in peaks.values()), peaks
        assert limits[LEADER].oom_kills() == limits[0].oom_kills() == 0
        nothing_left(bed)
    assert texts[("--tp", "2")] == texts[("--pp", "2")] and texts[("--tp", "2")]


def test_a_smaller_host_rules_the_caches_budget_tensor_parallel_and_in_stages(
    bed: Namespaces, limits: dict[int, cgroups.MemoryLimit], tmp_path: Path
) -> None:
    """The leader's host (1 GiB) and host 1 (512 MiB) serve a model whose keys and values are wide, with a LoRA
    adapter and a disk tier, TP=2 then PP=2, four requests at once (one through the adapter and one without it on
    the same prompt, one asking two choices): the caches' budget that rules is the one holding the fewest tokens
    (under tensor parallelism the smaller host's; in stages each rank's for its layers), every request is answered
    alike both ways, each rank writes its disk tier, and the OOM killer ends nothing."""
    model = make_tiny_model(tmp_path / "wide", "llama", hidden=256, layers=4, heads=32)
    adapter = make_adapter(model, tmp_path / "adapter", seed=1)
    hostfile = bed.hostfile([bed.entry(LEADER), bed.entry(1)], "smaller.json")
    kills = [limit.oom_kills() for limit in limits.values()]
    texts = {}
    for split in (("--tp", "2"), ("--pp", "2")):
        server = start(
            bed, limits, tmp_path, "--model", str(model), "--adapter", f"a={adapter}", "--hosts", str(hostfile), *split,
            "--prefix-cache-dir", str(disk := tmp_path / f"kv{split[0]}"),
        )  # fmt: skip
        try:
            server.port = server.wait_log("serving", timeout=240)["port"]
            said = server.find_log("memory budget")
            assert said is not None
            ranks = {rank["rank"]: rank for rank in said["ranks"]}
            print(" ".join(split), {r: (v["total_bytes"] >> 20, v["budget_tokens"]) for r, v in ranks.items()})
            assert ranks[1]["total_bytes"] == SMALL and ranks[0]["total_bytes"] == LIMIT
            fewest = min(ranks, key=lambda r: ranks[r]["budget_tokens"])
            assert said["rank"] == fewest and said["host"] == ranks[fewest]["host"], said
            if split == ("--tp", "2"):
                assert fewest == 1, ranks  # the same share on each: the smaller host holds fewer tokens

            def ask(i: int, url: str = f"{server.url}/v1/completions") -> httpx.Response:
                prompt = f"{1 if i == 3 else i} hello"
                body = {"model": "a" if i == 1 else model.name, "prompt": prompt, "max_tokens": 64}
                return httpx.post(url, json={**body, "temperature": 0.0, "n": 2 if i == 2 else 1}, timeout=240)

            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(ask, range(4)))
            assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
            texts[split] = [[c["text"] for c in r.json()["choices"]] for r in replies]
            assert len(texts[split][2]) == 2 and texts[split][1] != texts[split][3], texts[split]  # the adapter acts
        finally:
            assert server.stop() == 0, server.stderr()[-3000:]
        nothing_left(bed)
        assert {path.name.split(".")[1] for path in disk.glob("*.kv")} == {"r0", "r1"}  # each rank's disk tier
    assert texts[("--tp", "2")] == texts[("--pp", "2")]
    assert [limit.oom_kills() for limit in limits.values()] == kills


def test_one_limited_host_alone_is_refused_before_anything_loads(
    bed: Namespaces, limits: dict[int, cgroups.MemoryLimit], big_model: Path, tmp_path: Path
) -> None:
    """The leader's host alone (rank 0 in the leader), then host 1 beside it (its worker's handshake): each
    refused naming the host, the memory it needed and its limit, in seconds and with nothing loaded."""
    limits[LEADER].reset_peak()
    alone = ended(start(bed, limits, tmp_path, "--model", str(big_model)), 30)
    print(alone)
    assert "rank 0 on localhost" in alone and f"needs {weights(big_model) / (1 << 30):.2f} GiB" in alone, alone
    assert "under its memory cgroup's limit of 1.00 GiB" in alone, alone
    assert (limits[LEADER].peak() or 0) < weights(big_model) / 4  # refused before the weights were read
    hostfile = bed.hostfile([bed.entry(LEADER), bed.entry(1)], "small.json")
    small = ended(start(bed, limits, tmp_path, "--model", str(big_model), "--hosts", str(hostfile), "--tp", "2"), 60)
    print(small)
    assert f"rank 1 on root@{bed.ip(1)}" in small and "limit of 512 MiB" in small, small
    nothing_left(bed)


def test_a_host_whose_handshake_cannot_tell_is_reported_killed_by_the_oom_killer(
    bed: Namespaces, limits: dict[int, cgroups.MemoryLimit], big_model: Path, tmp_path: Path
) -> None:
    """Host 1 says it has room it has not (as a host whose limit neuron cannot read would): its worker is killed
    by the kernel's OOM killer partway through its load, and the leader ends naming the rank, the host and the
    OOM killer, with what to do."""
    kills = limits[1].oom_kills()
    liar = {
        **bed.entry(1),
        "neuron": bed.neuron_command({faults.FAKE_HOST_ENV: f"free_memory={1 << 40}"}, faults.ENTRY),
    }
    hostfile = bed.hostfile([bed.entry(LEADER), liar], "liar.json")
    last = ended(start(bed, limits, tmp_path, "--model", str(big_model), "--hosts", str(hostfile), "--tp", "2"), 120)
    print(last)
    assert limits[1].oom_kills() > kills
    assert f"rank 1 on root@{bed.ip(1)}" in last and "killed by the kernel's OOM killer" in last, last
    assert "limit of 512 MiB" in last and "split the model over more ranks" in last, last
    nothing_left(bed)


def test_a_worker_lost_while_rank_0_loads_ends_the_leader_with_its_error_not_an_abort(
    big_model: Path, tmp_path: Path
) -> None:
    """Rank 0, abandoned inside its load when a peer dies, is still inside MLX as the leader exits: the exit must
    not tear MLX down under it (the C++ runtime aborted the process, SIGABRT, after the error was said)."""
    server = Server("--model", str(big_model), "--tp", "2", log_path=tmp_path / "serve.log")
    try:
        server.wait_log("group ready", timeout=120)
        children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
        before = rss(server.process.pid)
        wait_until(lambda: rss(server.process.pid) > before + (100 << 20), 60, "rank 0 to be loading its weights")
        for worker in map(int, children):
            os.kill(worker, signal.SIGKILL)
        last = ended(server, 120)
    finally:
        server.stop()
    assert "rank 1 on localhost: worker pid" in last and "killed by SIGKILL" in last, last
