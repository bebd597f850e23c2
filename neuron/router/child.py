"""One model's server: a ``neuron serve`` of its own on loopback, started when the model loads and stopped when it
unloads. Its log entries become the router's, each naming its model, so that the journal holds one stream.

The child is told everything on its command line and in its environment (the server's settings, then the model's
own), and an empty settings file, so that it never reads the router's ``[[models]]`` and becomes a router itself.
Secrets travel in the environment, never on a command line other users can read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import orjson
import structlog

from neuron.router.declared import Declared

log = structlog.get_logger("neuron.router")

# What ties a process to systemd or to the router's own start: a model's server must not answer for the router.
NOT_INHERITED = (
    "NOTIFY_SOCKET",
    "LISTEN_PID",
    "LISTEN_FDS",
    "LISTEN_FDNAMES",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "JOURNAL_STREAM",
)
LEVELS = {"trace": "debug", "debug": "debug", "info": "info", "warning": "warning", "error": "error"}
# What a model's server holds beside its weights, as a share of them and in bytes per process: Python, MLX's
# buffers, the first steps' caches. A guess that errs high: a model refused for it could have loaded, one let in
# under it could not.
BESIDE_WEIGHTS = 0.2
PER_PROCESS = 256 << 20
# After SIGTERM, beyond the server's own --drain-timeout (its requests' drain, then its workers' stop), SIGKILL.
STOP_MARGIN_S = 15.0


class LoadFailed(RuntimeError):
    """The model's server exited before it served; the message says why, in its own words where it gave them."""


class Child:
    """``model``'s server process: its state (unloaded, loading, loaded, failed), the port it answers on, and how
    many requests are in flight for it."""

    def __init__(
        self, model: Declared, argv: list[str], env: dict[str, str], ranks: int | None, drain_timeout: float = 0.0
    ) -> None:
        self.model = model
        self.drain_timeout = drain_timeout  # its server's: how long a SIGTERM lets its requests finish
        self.ranks = ranks  # its ranks, all on this host; None where a hostfile places them
        self.argv = argv  # the server's settings and the model's own, as ``neuron serve`` flags
        self.env = env  # its whole environment
        self.state = "unloaded"
        self.why = ""  # why it failed, or why it was unloaded last
        self.port = 0
        self.waiting = 0  # requests waiting for it to load
        self.in_flight = 0  # requests forwarded to it and not yet answered whole
        self.last_used = time.monotonic()
        self.keep_alive = model.keep_alive  # a request's ``keep_alive`` changes it, as Ollama's does
        self.attempts = 0  # loads begun
        self.loads = 0  # loads that served
        self.process: anyio.abc.Process | None = None
        self._served = anyio.Event()
        self._exited = anyio.Event()

    def need(self) -> int | None:
        """The bytes its server will hold on this host, from its weights' files; None where that is not known
        before it loads (a Hub name) or not here (ranks on other hosts)."""
        if self.ranks is None or (weights := weights_bytes(self.model.source)) is None:
            return None
        return need_bytes(weights, self.ranks)

    def held(self) -> int:
        """The bytes its server's processes hold now (their resident sets, from /proc): the leader's and its
        workers'."""
        if self.process is None:
            return 0
        return sum(_resident_bytes(pid) for pid in _tree(self.process.pid))

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "neuron",
            "serve",
            *self.argv,
            "--model",
            self.model.source,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--log-format",
            "json",
            "--config",
            os.devnull,
        ]

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the server and wait until it serves; ``LoadFailed`` when it exits first."""
        self.state, self.why, self.port = "loading", "", 0
        self._served, self._exited = anyio.Event(), anyio.Event()
        started = time.perf_counter()
        log.info("model state", model=self.model.name, state="loading", source=self.model.source)
        self.process = await anyio.open_process(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=self.env,
            start_new_session=True,  # a signal to the router's terminal or unit is the router's to pass on
        )
        tg.start_soon(self._relay, self.process)
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as first:

                async def served() -> None:
                    await self._served.wait()
                    first.cancel_scope.cancel()

                async def exited() -> None:
                    await self._exited.wait()
                    first.cancel_scope.cancel()

                first.start_soon(served)
                first.start_soon(exited)
        if not self._served.is_set():
            self.state = "failed"
            self.why = self.why or f"its server exited with status {self.process.returncode} before it served"
            log.error("model state", model=self.model.name, state="failed", why=self.why)
            raise LoadFailed(self.why)
        self.state = "loaded"
        self.loads += 1
        self.last_used = time.monotonic()
        ms = round((time.perf_counter() - started) * 1e3)
        log.info("model state", model=self.model.name, state="loaded", port=self.port, ms=ms)

    async def stop(self, why: str) -> None:
        """SIGTERM, then SIGKILL if it has not exited within its drain and ``STOP_MARGIN_S`` (an unload waits until
        no request is in flight first; a stop of the router lets the server drain its own)."""
        process = self.process
        self.state = "unloading"
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGTERM)
            grace = self.drain_timeout + STOP_MARGIN_S
            with anyio.move_on_after(grace):
                await self._exited.wait()
            if process.returncode is None:
                log.warning("model server did not stop; killed", model=self.model.name, grace_s=grace)
                process.kill()
                await self._exited.wait()
        self.state, self.why, self.port, self.process = "unloaded", why, 0, None
        log.info("model state", model=self.model.name, state="unloaded", why=why)

    async def _relay(self, process: anyio.abc.Process) -> None:
        """Each line the server writes, as the router's own entry with the model's name; the port once it serves;
        its exit."""
        assert process.stderr is not None
        buffer = b""
        try:
            async for data in process.stderr:
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self._entry(line)
            if buffer:
                self._entry(buffer)
        finally:
            with anyio.CancelScope(shield=True):
                await process.wait()
            if self.state == "loaded" and process is self.process:
                self.state, self.why = "failed", f"its server exited with status {process.returncode}"
                log.error("model state", model=self.model.name, state="failed", why=self.why)
            self._exited.set()

    def _entry(self, line: bytes) -> None:
        try:
            entry: dict[str, Any] = orjson.loads(line)
        except orjson.JSONDecodeError:  # what it wrote before its logging began: argparse's refusal, a traceback
            text = line.decode(errors="replace").strip()
            if text.startswith("neuron serve: error:") or text.startswith("neuron: error:"):
                self.why = text.split("error:", 1)[1].strip()
            entry = {"event": "native output", "level": "info", "line": text}
        if not isinstance(entry, dict):
            return
        event = str(entry.pop("event", ""))
        level = LEVELS.get(str(entry.pop("level", "info")), "info")
        entry.pop("timestamp", None)
        entry.pop("model", None)
        if event == "serving" and not self._served.is_set():
            self.port = int(entry.get("port", 0))
            self._served.set()
        if level == "error" and not self._served.is_set():
            self.why = str(entry.get("error") or entry.get("cause") or event)
        getattr(log, level)(event, model=self.model.name, **entry)


def need_bytes(weights: int, processes: int) -> int:
    """What a server holds on a host whose ``processes`` ranks hold ``weights`` bytes of the model between them."""
    return int(weights * (1 + BESIDE_WEIGHTS)) + processes * PER_PROCESS


def gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def weights_bytes(source: str) -> int | None:
    """The bytes of a model's weights' files (a folder's safetensors, a GGUF file); None where there are none here
    to read (a Hub name)."""
    path = Path(source).expanduser()
    files = [*path.glob("*.safetensors"), *path.glob("*.gguf")] if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        return None
    return sum(f.stat().st_size for f in files)


def _tree(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        try:
            queue += [int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            continue
    return found


def _resident_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
