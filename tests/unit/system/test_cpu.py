"""What a Linux CPU process is started with (``neuron.system.cpu.preloads``): the malloc beside the BLAS, and the
refusals of a ``NEURON_MALLOC`` that names nothing usable."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron.system import cpu


@pytest.fixture
def no_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.BLAS_ENV, "reference")  # the malloc alone: no BLAS, no interposer to build
    monkeypatch.delenv(cpu.MALLOC_ENV, raising=False)
    monkeypatch.delenv(cpu.MALLOC_CONF_ENV, raising=False)


@pytest.fixture
def jemalloc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An installed jemalloc, where the distributions put it (a stand-in file: nothing here loads it)."""
    installed = tmp_path / "libjemalloc.so.2"
    installed.write_bytes(b"")
    monkeypatch.setattr(cpu, "JEMALLOC_FILES", (str(tmp_path / "missing" / "libjemalloc.so.2"), str(installed)))
    return str(installed)


@pytest.mark.usefixtures("no_blas")
def test_jemalloc_is_preloaded_where_installed_with_its_pages_given_back(jemalloc: str) -> None:
    assert cpu.preloads() == ([jemalloc], {cpu.MALLOC_CONF_ENV: cpu.JEMALLOC_CONF})


@pytest.mark.usefixtures("no_blas")
def test_an_operators_malloc_conf_is_kept(jemalloc: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.MALLOC_CONF_ENV, "narenas:2")
    assert cpu.preloads() == ([jemalloc], {})


@pytest.mark.usefixtures("no_blas", "jemalloc")
def test_off_keeps_glibcs_malloc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.MALLOC_ENV, "off")
    assert cpu.preloads() == ([], {})


@pytest.mark.usefixtures("no_blas")
def test_without_jemalloc_nothing_is_preloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "JEMALLOC_FILES", (str(tmp_path / "libjemalloc.so.2"),))
    assert cpu.find_malloc() is None
    assert cpu.preloads() == ([], {})


@pytest.mark.usefixtures("no_blas")
def test_a_path_names_another_malloc_without_jemallocs_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = next(p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib/aarch64-linux-gnu/libc.so.6", "/lib64/libc.so.6")
                if Path(p).is_file())  # fmt: skip
    monkeypatch.setenv(cpu.MALLOC_ENV, libc)
    assert cpu.preloads() == ([libc], {})


@pytest.mark.usefixtures("no_blas")
@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.so", None, "no such file; give off or the path of a malloc library"),
        ("libnot.so", b"not a library", "cannot be loaded"),
    ],
)
def test_a_path_that_cannot_be_preloaded_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, content: bytes | None, message: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    monkeypatch.setenv(cpu.MALLOC_ENV, str(path))
    with pytest.raises(cpu.MallocError, match=message):
        cpu.preloads()
