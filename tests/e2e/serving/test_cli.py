"""`neuron generate` end to end: real leader, real workers, the real embedded SmolLM2."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from neuron.system import cpu
from testkit import ROOT, neuron_command, run_neuron, run_neuron_side_by_side

SUMMARY = re.compile(r"^\d+ tokens, [\d.]+ tokens/s, time to first token [\d.]+ s$", re.M)
INFO = re.compile(r"\[info|\"level\": \"info\"")  # an info line, in the console's format or JSON's


def test_smollm2_chat_answers_paris(smollm2_paris: subprocess.CompletedProcess[str]) -> None:
    """``neuron generate --chat`` with no --model (conftest's PARIS; the fixture checks it exits 0)."""
    assert "Paris" in smollm2_paris.stdout
    assert "{" not in smollm2_paris.stdout  # no log line leaked into the text


def test_piped_the_answer_alone_goes_to_stdout_and_one_summary_line_to_stderr(smollm2: Path) -> None:
    done = run_neuron("generate", "--model", str(smollm2), "--chat", "What is the capital of France?")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "The capital of France is Paris.", done.stdout
    assert SUMMARY.search(done.stderr) and not INFO.search(done.stderr), done.stderr
    assert "━" not in done.stderr  # no progress bar where nobody watches


def _on_a_terminal(*args: str, timeout: float = 120) -> str:
    """What ``neuron ARGS`` writes to a pseudo-terminal holding its stdout and stderr, as a person sees it."""
    main, sub = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100"}
    proc = subprocess.Popen(neuron_command(*args), stdin=sub, stdout=sub, stderr=sub, cwd=ROOT, env=env)
    os.close(sub)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([main], [], [], deadline - time.monotonic())[0]:
                break
            try:
                data = os.read(main, 65536)
            except OSError:  # EIO: the process closed its end
                break
            if not data:
                break
            out += data
    finally:
        os.close(main)
        assert proc.wait(timeout=30) == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


def test_on_a_terminal_a_progress_bar_then_the_answer_then_a_summary(smollm2: Path) -> None:
    seen = _on_a_terminal("generate", "--model", str(smollm2), "--chat", "What is the capital of France?")
    loading = seen.find(f"loading {smollm2.name} on 1 rank(s)")
    answer = seen.find("The capital of France is Paris.\r\n")  # the terminal turns each newline into \r\n
    summary = SUMMARY.search(seen.replace("\r\n", "\n"))
    assert 0 <= loading < answer and "━" in seen[loading:answer], seen
    assert summary is not None and summary.start() > answer, seen
    assert not INFO.search(seen), seen
    more = _on_a_terminal("generate", "--model", str(smollm2), "--max-tokens", "2", "--log-level", "info", "Hi")
    assert INFO.search(more), more  # --log-level asks for more


# SmolLM2 over three ranks against one: tests/e2e/caching/test_prefix_cache.py's SmolLM2 test, whose three-rank and
# one-rank servers compare prompts computed with nothing cached (this file's own TP=3 run started the same loads a
# second time). The command line's path over several ranks is held to one rank's below.


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_tp2_equals_tp1_through_the_cli(tiny_models: dict[str, Path], arch: str) -> None:
    args = ("generate", "--model", str(tiny_models[arch]), "--max-tokens", "32", "hello")
    tp1, tp2 = run_neuron_side_by_side(args, (*args, "--tp", "2"))
    assert tp1.returncode == 0 and tp2.returncode == 0, tp1.stderr + tp2.stderr
    assert tp2.stdout == tp1.stdout


def test_text_streams_while_generating(smollm2: Path) -> None:
    proc = subprocess.Popen(
        neuron_command(
            "generate", "--model", str(smollm2), "--max-tokens", "200", "Write a long story about a dragon."
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.read1(1)  # type: ignore[attr-defined]
        assert first and proc.poll() is None, "no text arrived before the generation ended"
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == 0


def _one_token_logged(smollm2: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One token, with the startup's info lines (the BLAS in use) that generate leaves out by default."""
    return run_neuron("generate", "--model", str(smollm2), "--max-tokens", "1", "--log-level", "info", "Hi", env=env)


@pytest.mark.skipif(not cpu.is_linux_cpu_backend(), reason="the hint is for the Linux CPU backend")
def test_without_openblas_a_hint_says_how_to_get_it(smollm2: Path) -> None:
    done = _one_token_logged(smollm2, {cpu.BLAS_ENV: "reference"})
    assert done.returncode == 0, done.stderr
    assert '"blas": "reference BLAS bundled with mlx"' in done.stderr
    assert "apt-get install libopenblas0-pthread" in done.stderr


def test_startup_log_names_the_blas(smollm2: Path) -> None:
    """The README's commands start with scripts/fast-blas: where it could install OpenBLAS and a compiler (root and
    apt-get, as in CI's clean clone), the server must be on both; elsewhere on the best installed library, or print
    the hint."""
    done = _one_token_logged(smollm2)
    assert done.returncode == 0, done.stderr
    if not cpu.is_linux_cpu_backend():
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):  # scripts/fast-blas installed OpenBLAS, jemalloc and gcc
        assert '"blas": "OpenBLAS' in done.stderr, "run scripts/fast-blas (the README's commands do)"
        assert "one-row products by sgemv" in done.stderr, done.stderr
        assert '"malloc": "jemalloc (' in done.stderr, done.stderr
    elif cpu.find_blas():
        assert re.search(r'"blas": "(OpenBLAS|BLIS) ', done.stderr), done.stderr
    else:
        assert "apt-get install libopenblas0-pthread" in done.stderr


def test_neuron_blas_picks_the_library_or_says_what_is_wrong(smollm2: Path, tmp_path: Path) -> None:
    """``NEURON_BLAS`` names a library, and every wrong value is refused before loading, saying what to give."""
    not_blas = tmp_path / "libnot.so"
    not_blas.write_bytes(b"not a library")
    refused = {
        "/no/such/lib.so": "no such file; give openblas, blis, reference or the path",
        str(not_blas): "cannot be loaded",
    }
    for value, message in refused.items():
        done = run_neuron("generate", "--model", str(smollm2), "Hi", env={cpu.BLAS_ENV: value})
        assert done.returncode == 2 and message in done.stderr, done.stderr
    for library in cpu.LIBRARIES:
        done = _one_token_logged(smollm2, {cpu.BLAS_ENV: library.name.lower()})
        if cpu.installed(library) is None:
            assert done.returncode == 2 and f"{library.name} is not installed" in done.stderr, done.stderr
        else:
            assert done.returncode == 0 and f'"blas": "{library.name} (' in done.stderr, done.stderr


@pytest.mark.skipif(not cpu.is_linux_cpu_backend(), reason="the malloc is chosen on the Linux CPU backend")
def test_neuron_malloc_keeps_glibcs_or_says_what_is_wrong(smollm2: Path) -> None:
    """``NEURON_MALLOC=off`` keeps glibc's malloc (the log says so), and a path that names nothing is refused before
    loading, saying what to give."""
    done = _one_token_logged(smollm2, {cpu.MALLOC_ENV: "off"})
    assert done.returncode == 0 and '"malloc": "glibc"' in done.stderr, done.stderr
    done = run_neuron("generate", "--model", str(smollm2), "Hi", env={cpu.MALLOC_ENV: "/no/such/libmalloc.so"})
    assert done.returncode == 2 and "no such file; give off or the path of a malloc library" in done.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("--model", "/no/such/model", "x"), 1, "does not exist"),
        (("--tp", "2", "x"), 1, "9 attention heads, which do not divide over 2 ranks"),
        (("--max-tokens", "0", "x"), 2, "--max-tokens must be at least 1"),
        (("--tp", "0", "x"), 2, "--tp must be at least 1"),
        (("--temperature", "-1", "x"), 2, "temperature must lie in"),  # checked before loading
    ],
)
def test_errors_go_to_stderr_with_a_nonzero_exit(
    smollm2: Path, tmp_path: Path, args: tuple[str, ...], code: int, message: str
) -> None:
    """A refusal leaves nothing behind: the workers started early (``--tp 2``) are killed, untold, and write no
    temporary files before they join a group."""
    done = run_neuron("generate", *args, env={"TMPDIR": str(tmp_path)})
    assert done.returncode == code
    assert message in done.stderr
    assert done.stdout == ""
    assert list(tmp_path.iterdir()) == []
