"""The device decides the machinery: which MLX build is installed, the GPU each nccl rank gets, and the refusals.

Fast tests of the decisions (no model, no subprocess), on whatever machine runs them: the builds are real
distributions written to a folder put on ``sys.path``, and a host's GPU count is faked through the handshake's
own seam (``NEURON_TEST_FAKE_HOST``). The last two tests run ``neuron generate --backend nccl`` on this host.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron.launch.checks import Refused, check_gpus
from neuron.launch.dataplane import backend_setup, spawn_env
from neuron.launch.hosts import Host, describe_host, local_hosts
from neuron.launch.ssh import remote_command
from neuron.system import cpu, device
from testkit import faults, run_neuron
from testkit.faults import FAKE_HOST_ENV

CPU_LIBRARY, CUDA_LIBRARY = 2100, 14600  # bytes of each build's libmlx.so, as small stand-ins


def _install(site: Path, name: str, library: int | None = None) -> None:
    """A distribution as pip leaves it: its metadata, and a record of ``mlx/lib/libmlx.so`` when it ships one."""
    info = site / f"{name.replace('-', '_')}-0.32.4.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.32.4\n")
    record = f"{info.name}/METADATA,,\n"
    if library is not None:
        record += f"mlx/lib/libmlx.so,sha256=x,{library}\n"
    (info / "RECORD").write_text(record)


def _site(tmp_path: Path, builds: dict[str, int], on_disk: int) -> Path:
    site = tmp_path / "site"
    _install(site, "mlx")
    for name, size in builds.items():
        _install(site, name, size)
    (site / "mlx" / "lib").mkdir(parents=True)
    (site / "mlx" / "lib" / "libmlx.so").write_bytes(b"\0" * on_disk)
    return site


@pytest.fixture
def fresh_backend() -> Iterator[None]:
    device.backend.cache_clear()
    yield
    device.backend.cache_clear()


@pytest.mark.parametrize(
    ("builds", "on_disk", "expected"),
    [
        ({"mlx-cpu": CPU_LIBRARY}, CPU_LIBRARY, "cpu"),
        ({"mlx-cuda-12": CUDA_LIBRARY}, CUDA_LIBRARY, "cuda"),
        ({"mlx-cuda-13": CUDA_LIBRARY}, CUDA_LIBRARY, "cuda"),
        # Both installed: the one installed last replaced the other's library, and MLX loads that one.
        ({"mlx-cpu": CPU_LIBRARY, "mlx-cuda-13": CUDA_LIBRARY}, CUDA_LIBRARY, "cuda"),
        ({"mlx-cpu": CPU_LIBRARY, "mlx-cuda-13": CUDA_LIBRARY}, CPU_LIBRARY, "cpu"),
    ],
)
def test_the_installed_build_decides_the_backend_on_linux(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_backend: None,
    builds: dict[str, int],
    on_disk: int,
    expected: str,
) -> None:
    monkeypatch.setattr(sys, "path", [str(_site(tmp_path, builds, on_disk))])
    assert device.backend_for("linux", device.installed_builds()) == expected
    if sys.platform == "linux":
        # What the fast path asks: on a GPU, no BLAS re-exec, no interposer, no pinning.
        assert cpu.is_linux_cpu_backend() is (expected == "cpu")


def test_metal_on_macos_and_a_bare_mlx_on_linux_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_backend: None
) -> None:
    assert device.backend_for("darwin", ["mlx-metal"]) == "metal"
    assert device.backend_for("darwin", []) == "metal"
    assert device.backend_for("linux", []) == "cpu"
    site = tmp_path / "site"
    _install(site, "mlx")
    monkeypatch.setattr(sys, "path", [str(site)])
    if sys.platform == "linux":  # mlx alone: its core fails to load, and neuron says what to install
        problem = device.cannot_load(ImportError("libmlx.so: cannot open shared object file"))
        assert problem.startswith("MLX has no build installed for this machine")
        assert "pip install 'neuron[cpu]'" in problem and "'neuron[cuda13]'" in problem


def test_this_machines_build_is_found() -> None:
    """The venv the tests run in: its MLX build, seen through the real site-packages."""
    import mlx.core as mx

    builds = device.installed_builds()
    assert len(builds) <= 1, builds
    if sys.platform == "linux":
        assert builds, "no MLX build installed"
        assert device.backend() == ("cuda" if mx.cuda.is_available() else "cpu")


def test_the_startup_line_names_the_gpu_and_its_memory_or_the_cpu() -> None:
    h100 = {"device_name": "NVIDIA H100 80GB HBM3", "total_memory": 85 << 30, "free_memory": 84 << 30}
    assert device.describe_device("cuda", h100) == "CUDA GPU NVIDIA H100 80GB HBM3 (85.0 GiB, 84.0 GiB free)"
    m2 = {"device_name": "Apple M2 Max", "memory_size": 64 << 30, "max_recommended_working_set_size": 48 << 30}
    assert device.describe_device("metal", m2) == "Metal GPU Apple M2 Max (64.0 GiB, 48.0 GiB for the GPU)"
    epyc = {"device_name": "AMD EPYC", "architecture": "x86_64"}
    assert device.describe_device("cpu", epyc) == "CPU AMD EPYC (x86_64)"  # its BLAS is logged beside it
    # What the pipeline split, the handshake and the memory budget count on a GPU: the GPU's room, not the host's;
    # on CUDA the buffers MLX holds freed for reuse are room too, on Metal what MLX holds is not.
    assert device.gpu_memory_of(h100) == (84 << 30, 85 << 30)
    assert device.gpu_memory_of(h100, active=10 << 30, cached=1 << 30) == (85 << 30, 85 << 30)
    assert device.gpu_memory_of(m2) == (48 << 30, 48 << 30)
    assert device.gpu_memory_of(m2, active=40 << 30, cached=1 << 30) == (8 << 30, 48 << 30)
    assert device.gpu_memory_of(epyc) is None


def test_each_nccl_rank_is_given_the_next_gpu_of_its_own_machine_when_spawned() -> None:
    hosts = [*local_hosts(2), Host("gpu2", ("10.0.0.2",)), Host("gpu2", ("10.0.0.2",)), Host("gpu2", ("10.0.0.2",))]
    gpus = [spawn_env("nccl", rank, hosts, None).get("CUDA_VISIBLE_DEVICES") for rank in range(1, 5)]
    assert gpus == ["1", "0", "1", "2"]  # rank 0, in the leader, uses the first GPU its machine lists
    # The leader's own CUDA_VISIBLE_DEVICES, where an operator set one, is what its machine's ranks share.
    assert spawn_env("nccl", 1, hosts, "2,3")["CUDA_VISIBLE_DEVICES"] == "3"
    assert spawn_env("nccl", 2, hosts, "2,3")["CUDA_VISIBLE_DEVICES"] == "0"  # another machine: its own GPUs
    assert spawn_env("ring", 1, hosts, None) == {}
    # On another host the variable rides the command line (sshd passes none on) ...
    command = remote_command(hosts[3], 3, 5, spawn_env("nccl", 3, hosts, None))
    assert command.startswith("exec env CUDA_VISIBLE_DEVICES=1 ") and command.endswith("--rank 3 --world-size 5")
    # ... and not at init, when CUDA has long read it.
    env, _ = backend_setup("nccl", 1, [["127.0.0.1:5000"], ["127.0.0.1:5001"]], hosts[:2])
    assert "CUDA_VISIBLE_DEVICES" not in env


def _handshakes(monkeypatch: pytest.MonkeyPatch, fake: str, world_size: int) -> list:
    monkeypatch.setenv(FAKE_HOST_ENV, fake)
    return [faults.fake_host(describe_host(rank), rank) for rank in range(world_size)]


def test_a_machine_with_fewer_gpus_than_its_nccl_ranks_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = [*local_hosts(1), Host("gpu2", ("10.0.0.2",)), Host("gpu2", ("10.0.0.2",))]
    infos = _handshakes(monkeypatch, "0:gpus=8;1:gpus=1;2:gpus=1", 3)
    with pytest.raises(Refused) as refused:
        check_gpus("nccl", infos, hosts, None)
    message = str(refused.value)
    assert message.startswith("gpu2 (") and "has 1 GPU (as its driver lists them), but ranks 1, 2" in message
    assert "--backend ring" in message
    check_gpus("ring", infos, hosts, None)  # the ring shares a GPU (or none) without complaint
    check_gpus("nccl", _handshakes(monkeypatch, "gpus=2", 3), hosts, None)  # two each: room for both

    # The leader's machine: counted from its CUDA_VISIBLE_DEVICES where it sets one.
    local = local_hosts(2)
    check_gpus("nccl", _handshakes(monkeypatch, "gpus=2", 2), local, None)
    with pytest.raises(Refused, match=r"has 1 GPU \(CUDA_VISIBLE_DEVICES=3\), but ranks 0, 1 are placed on it"):
        check_gpus("nccl", _handshakes(monkeypatch, "gpus=2", 2), local, "3")


def test_nccl_on_a_host_without_enough_gpus_is_refused_before_anything_loads(tiny_models: dict[str, Path]) -> None:
    """The whole path: the worker spawned, its handshake's GPU count (this host's real one, faked to 1 where it
    has GPUs), and neuron's refusal before any rank loads the model."""
    fake = {} if device.gpu_count() == 0 else {FAKE_HOST_ENV: "gpus=1"}
    done = run_neuron(
        "generate",
        "--model",
        str(tiny_models["qwen3"]),
        "--tp",
        "2",
        "--backend",
        "nccl",
        "--log-level",
        "info",  # so that a share loaded would say so
        "hi",
        env=fake,
        module=faults.ENTRY,
    )
    assert done.returncode == 1, done.stderr
    assert "nccl needs a GPU of its own for each rank" in done.stderr and "ranks 0, 1 are placed on it" in done.stderr
    assert "share loaded" not in done.stderr


@pytest.mark.skipif(device.backend() == "cuda", reason="where nccl can start, it does not fail at init")
def test_an_nccl_failure_at_init_is_neurons_error_naming_rank_host_and_what_to_check(
    tiny_models: dict[str, Path],
) -> None:
    """MLX's CPU build has no nccl: with two GPUs faked, every rank fails inside MLX's init, and each failure
    reads as neuron's, naming the rank, its host and its GPU, with the library's words kept."""
    done = run_neuron(
        "generate",
        "--model",
        str(tiny_models["qwen3"]),
        "--tp",
        "2",
        "--backend",
        "nccl",
        "hi",
        env={FAKE_HOST_ENV: "gpus=2"},
        module=faults.ENTRY,
    )
    assert done.returncode == 1, done.stderr
    error = next(line for line in done.stderr.splitlines() if line.startswith("neuron: error:"))
    for rank in (0, 1):
        assert re.search(rf"rank {rank} on localhost: [\w: ]*could not join the nccl group \(RuntimeError: ", error)
    assert "it was given CUDA_VISIBLE_DEVICES=1;" in error and "NCCL_DEBUG=INFO" in error
