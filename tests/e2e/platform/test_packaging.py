"""The .deb and .rpm that ``packaging/build`` makes: their contents, their units, and the server inside them.

Needs the packaging tools (CI installs them as root): /usr/bin/python3.11 for
the packaged venv, nfpm (the test extra), dpkg-deb, rpm, and systemd-analyze.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from neuron import __version__
from testkit import ROOT

UNITS = "usr/lib/systemd/system"
SECURITY_TARGET = 2.0
TOOLS = {
    "/usr/bin/python3.11": "python3.11",
    "dpkg-deb": "dpkg",
    "rpm": "rpm",
    "systemd-analyze": "systemd",
}

missing = [package for tool, package in TOOLS.items() if shutil.which(tool) is None]
pytestmark = [
    pytest.mark.packaging,
    pytest.mark.skipif(bool(missing), reason=f"needs the Debian packages: {' '.join(missing)}"),
]


def _expected() -> tuple[set[str], set[str]]:
    lines = (ROOT / "packaging" / "expected-contents.txt").read_text().splitlines()
    paths = {line for line in lines if line.startswith("/")}
    return {p for p in paths if not p.startswith("/opt/neuron/")}, {p for p in paths if p.startswith("/opt/neuron/")}


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([ROOT / "packaging" / "build", out], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return {
        "deb": out / f"neuron_{__version__}-1_amd64.deb",
        "rpm": out / f"neuron-{__version__}-1.x86_64.rpm",
    }


@pytest.fixture(scope="module")
def installed(packages: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The .deb unpacked into a root of its own, beside the host's own units (verify follows dependencies)."""
    root = tmp_path_factory.mktemp("root")
    subprocess.run(["dpkg-deb", "-x", packages["deb"], root], check=True)
    shutil.copytree("/usr/lib/systemd/system", root / UNITS, dirs_exist_ok=True, symlinks=True)
    for unit in ("neuron.service", "neuron.socket"):  # the host's copy must not stand in for ours
        assert (root / UNITS / unit).read_text() == (ROOT / "packaging" / unit).read_text()
    return root


def _listing(kind: str, package: Path) -> set[str]:
    if kind == "deb":
        out = subprocess.run(["dpkg-deb", "-c", package], capture_output=True, text=True, check=True).stdout
        # "drwxr-xr-x root/root 0 2026-01-01 00:00 ./opt/neuron/" or "... ./opt/neuron/bin/python -> python3.11"
        names = [line.split(None, 5)[5].split(" -> ")[0] for line in out.splitlines()]
        return {name.removeprefix(".").rstrip("/") for name in names if not name.endswith("/")}
    out = subprocess.run(["rpm", "-qlp", package], capture_output=True, text=True, check=True).stdout
    return set(out.splitlines())


@pytest.mark.parametrize("kind", ["deb", "rpm"])
def test_package_contents_match_the_expected_list(packages: dict[str, Path], kind: str) -> None:
    outside, inside = _expected()
    files = _listing(kind, packages[kind])
    if kind == "rpm":  # rpm lists directories too (each an ancestor of another entry); only the files are compared
        files -= {path[:i] for path in files for i, c in enumerate(path) if c == "/" and i}
    assert {f for f in files if not f.startswith("/opt/neuron/")} == outside
    assert inside <= files, sorted(inside - files)


def test_the_config_file_survives_upgrades(packages: dict[str, Path]) -> None:
    deb = subprocess.run(
        f"dpkg-deb --ctrl-tarfile {packages['deb']} | tar -xO ./conffiles", shell=True, capture_output=True, text=True
    )
    assert deb.stdout.split() == ["/etc/neuron/neuron.toml"]
    rpm = subprocess.run(["rpm", "-qp", "--configfiles", packages["rpm"]], capture_output=True, text=True)
    assert rpm.stdout.split() == ["/etc/neuron/neuron.toml"]
    flags = subprocess.run(
        ["rpm", "-qp", "--qf", "[%{FILENAMES} %{FILEFLAGS:fflags}\n]", packages["rpm"]], capture_output=True, text=True
    )
    assert "/etc/neuron/neuron.toml cn" in flags.stdout  # config, noreplace


def test_the_venv_was_rewritten_for_its_final_path(installed: Path) -> None:
    venv = installed / "opt" / "neuron"
    assert (venv / "bin" / "neuron").read_text().splitlines()[0] == "#!/opt/neuron/bin/python"
    assert "/opt/neuron" in (venv / "pyvenv.cfg").read_text()
    assert (venv / "bin" / "python3.11").readlink() == Path("/usr/bin/python3.11")
    leftovers = subprocess.run(["grep", "-rlI", "package-stage", venv], capture_output=True, text=True).stdout
    assert leftovers == ""


def test_the_units_verify_without_a_word(installed: Path) -> None:
    """``systemd-analyze verify`` prints even what it only warns about (unknown keys): any output is a failure."""
    units = [installed / UNITS / "neuron.service", installed / UNITS / "neuron.socket"]
    done = subprocess.run(
        ["systemd-analyze", "verify", f"--root={installed}", *units], capture_output=True, text=True, cwd=installed
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_the_service_is_hardened(installed: Path) -> None:
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={installed}", installed / UNITS / "neuron.service"],
        capture_output=True,
        text=True,
    )
    found = re.search(r"Overall exposure level for neuron.service: ([\d.]+)", done.stdout)
    assert found, done.stdout + done.stderr
    assert float(found.group(1)) <= SECURITY_TARGET, done.stdout


def test_the_packaged_server_answers(installed: Path) -> None:
    """The packaged venv, on the system's Python, runs the embedded model (``/opt/neuron`` is not on this host), its
    products through the kernel it builds from the package's own MLX headers and CMake files."""
    python = installed / "opt/neuron/bin/python"
    question = ["--chat", "--max-tokens", "12", "--log-level", "info", "What is the capital of France?"]
    done = subprocess.run(
        [python, "-m", "neuron", "generate", *question],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(installed)},
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "quantized products by neuron's kernel" in done.stderr, done.stderr[-3000:]
