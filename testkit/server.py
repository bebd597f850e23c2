"""A real ``neuron`` as a subprocess: the command line, a served instance on a free port, and its logs."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def neuron_command(*args: str, module: str = "neuron") -> list[str]:
    """``python -m neuron ARGS``; ``module``: an entry point in front of neuron (``testkit.faults.ENTRY``)."""
    return [sys.executable, "-m", module, *args]


def run_neuron(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None, module: str = "neuron"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        neuron_command(*args, module=module),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def _ended(process: subprocess.Popen[str]) -> None:
    """Killed where a wait ran out; nothing once it exited."""
    process.kill()
    process.wait()


def run_neuron_side_by_side(
    *commands: tuple[str, ...], timeout: float = 300, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """``run_neuron`` for each command, run side by side (a run starts with one process importing, so their starts
    overlap on the cores); each one's outcome, in order."""
    with contextlib.ExitStack() as stack:
        started = []
        for args in commands:
            out, err = (stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
            command = neuron_command(*args)
            process = subprocess.Popen(
                command, stdout=out, stderr=err, text=True, cwd=ROOT, env={**os.environ, **(env or {})}
            )
            stack.callback(_ended, process)
            started.append((process, out, err))
        done = []
        for process, out, err in started:
            process.wait(timeout=timeout)
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read()))
        return done


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    """A streamed reply's events: each JSON object, and the closing ``[DONE]``."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


class Server:
    """A real ``neuron serve`` subprocess on a free port; its log (JSON lines) lands in a file.

    With ``listen``, the server is socket-activated as systemd does it: the
    socket becomes its file descriptor 3, with ``LISTEN_PID`` and ``LISTEN_FDS``.
    With ``module``, it runs that entry point in front of neuron (``testkit.faults.ENTRY`` injects faults).
    With ``cgroup_procs`` (a cgroup's ``cgroup.procs``), it starts inside that cgroup, under its limits.
    """

    def __init__(
        self,
        *args: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        listen: socket.socket | None = None,
        module: str = "neuron",
        nofile: tuple[int, int] | None = None,
        cgroup_procs: Path | None = None,
    ):
        self.log_path = log_path
        self.args = args
        self.api_key = api_key
        self._log = open(log_path, "w")
        extra = ("--api-key", api_key) if api_key else ()
        command = neuron_command("serve", "--port", "0", "--log-level", "info", *extra, *args, module=module)
        fd = None
        if listen is not None:
            # LISTEN_PID must be the server's own pid, known only in the child: a shell sets it, then execs.
            command = ["sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" "$@"', *command]
            fd = listen.fileno()

        def setup() -> None:
            if fd is not None:
                os.dup2(fd, 3)  # the new descriptor is inheritable
            if nofile is not None:  # the descriptor limit an operator (systemd's LimitNOFILE=) would give
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
            if cgroup_procs is not None:  # starts inside a cgroup (its limits), as a systemd unit would
                cgroup_procs.write_text(str(os.getpid()))

        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            preexec_fn=setup if fd is not None or nofile is not None or cgroup_procs is not None else None,
            close_fds=listen is None,
        )
        self.port = 0

    def logs(self) -> list[dict]:
        """The log's entries. Every whole line of the leader's stderr must be one: what MLX's C++ (or a helper
        process) writes there arrives as ``native output`` entries, never as a piece of a line. The last line,
        while it is still being written, is left for the next read."""
        *whole, _ = self.log_path.read_text().split("\n")
        entries = []
        for line in filter(None, whole):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                entry = None
            assert isinstance(entry, dict), f"a line of the leader's stderr is no log entry: {line[:300]!r}"
            entries.append(entry)
        return entries

    def find_log(self, event: str, **fields: object) -> dict | None:
        for entry in self.logs():
            if entry.get("event") == event and all(entry.get(k) == v for k, v in fields.items()):
                return entry
        return None

    def wait_log(self, event: str, timeout: float = 120, **fields: object) -> dict:
        found: list[dict] = []

        def seen() -> bool:
            if (entry := self.find_log(event, **fields)) is not None:
                found.append(entry)
                return True
            assert self.process.poll() is None, f"neuron serve exited {self.process.returncode}:\n{self.stderr()}"
            return False

        wait_until(seen, timeout, f"log event {event!r} {fields}")
        return found[0]

    def start(self) -> Server:
        """Wait until it serves; a start that fails stops the server, so that no test leaves one behind."""
        try:
            self.port = self.wait_log("serving")["port"]
        except BaseException:
            self.stop(timeout=10)
            raise
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.log_path.read_text()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """/metrics scraped: (name, sorted labels) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        response = httpx.get(f"{self.url}/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples
        }

    def exit_code(self, timeout: float = 60) -> int:
        """Its exit code once it has ended on its own (the signal already sent, say): a client's stream can end
        while the server still shuts down, and ``stop``'s SIGTERM then would be a second one, which ends it at once
        (``neuron serve``'s rule), by the signal itself where its handler has already gone."""
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._log.close()


@contextmanager
def serving(tmp_path_factory: pytest.TempPathFactory, *args: str, **kwargs: object) -> Iterator[Server]:
    """A started server, stopped on exit; it must exit 0 on SIGTERM."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = Server(*args, log_path=log, **kwargs)  # type: ignore[arg-type]
    try:
        yield server.start()
    finally:
        rc = server.stop()
    assert rc == 0, server.stderr()


@contextmanager
def serving_side_by_side(
    tmp_path_factory: pytest.TempPathFactory, *commands: tuple[str, ...], **kwargs: object
) -> Iterator[list[Server]]:
    """A started server per command, started side by side (a start is mostly one process importing, so starts
    overlap on the cores), stopped on exit; each must exit 0 on SIGTERM."""
    servers: list[Server] = []
    try:
        for args in commands:
            servers.append(Server(*args, log_path=tmp_path_factory.mktemp("serve") / "serve.log", **kwargs))  # type: ignore[arg-type]
        yield [server.start() for server in servers]
    finally:
        codes = [server.stop() for server in servers]
    for server, rc in zip(servers, codes, strict=True):
        assert rc == 0, server.stderr()


def greedy_body(prompt: str, max_tokens: int, priority: int = 0, stream: bool = False) -> dict:
    """A completion of the tiny qwen3's, greedy and to its full length, at ``priority``."""
    return {
        "model": "qwen3",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "priority": priority,
        "stream": stream,
    }


def sigterm_mid_stream(server: Server, max_tokens: int) -> list[dict | str]:
    """SIGTERM once a greedy stream of the tiny qwen3 has begun; the rest of the stream (a cut connection raises)."""
    body = {"model": "qwen3", "prompt": "hello", "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        events = sse_events(response)
        next(events)
        server.process.terminate()
        return list(events)


# The embedded SmolLM2, found with no --model, asked one question on one rank (tests/conftest.py's smollm2_paris runs
# it once a session): the CLI test checks the answer; the pipeline, multi-host and HTTP tests hold theirs to its words.
PARIS = ("--chat", "--max-tokens", "24", "What is the capital of France?")

# One rank; every layer sliced over two; two pipeline stages, whose decode runs in two micro-batches.
SPLITS = {"tp1": ("--tp", "1"), "tp2": ("--tp", "2"), "pp2": ("--pp", "2", "--micro-batches", "2")}
