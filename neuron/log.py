"""Logging, configured once per process: JSON lines, readable lines on a terminal, or native journald fields.

Everything goes to stderr (or the journal's socket). A worker's stdout is the
protocol, and the leader's is the generated text (``neuron generate``), so no
log line may ever reach it.

Why a native journald sink: a ``<N>`` prefix on a stderr line sets only its
priority. Fields an operator can filter on (``journalctl -u neuron RANK=1
REQUEST_ID=...``) need the journal's own datagram protocol, which is small
enough to write here: ``KEY=value`` lines, or a length-prefixed value when it
holds a newline.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import os
import re
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import structlog

JOURNAL_SOCKET = "/run/systemd/journal/socket"
# Where the journal listens; a test, or a container with the socket mounted elsewhere, points it away.
JOURNAL_SOCKET_ENV = "NEURON_JOURNAL_SOCKET"
SYSLOG_IDENTIFIER = "neuron"

# syslog priorities, as journalctl -p reads them.
PRIORITIES = {"critical": 2, "error": 3, "exception": 3, "warning": 4, "info": 6, "debug": 7, "trace": 7}

_tracing = False
_debugging = False
_configured = ("warning", "json")


def configured() -> tuple[str, str]:
    """This process's log level and format (``auto`` resolved), as a worker should be told them."""
    return _configured


def debugging() -> bool:
    """Whether debug events are written: a per-step caller checks this before building one, as even a dropped
    event costs structlog a logger bound per call. The level is set once, before the objects that step are built,
    so they read this once, when built."""
    return _debugging


def tracing() -> bool:
    """Whether trace events (``trace``) are written; read once, as ``debugging``."""
    return _tracing


def configure(level: str, fmt: str, native_stderr: bool = False, **bound: object) -> str:
    """Set up this process's logging; returns the format in use (``auto`` resolved).

    ``fmt`` is ``json``, ``console``, ``journal``, or ``auto``: the journal when
    stderr is the journal (``$JOURNAL_STREAM``, as systemd sets it), console on
    a terminal, JSON otherwise. ``trace`` is below ``debug``: one event per step.
    ``native_stderr`` relays what native code writes to descriptor 2 as entries
    of their own (``NativeStderr``), from then on for the process's life.
    """
    global _tracing, _debugging, _configured, _native_stderr
    if native_stderr and _native_stderr is None:
        _native_stderr = NativeStderr()  # first: the logger below binds to the real stderr it leaves in sys.stderr
    if fmt == "auto":
        fmt = "journal" if stderr_is_journal() else "console" if sys.stderr.isatty() else "json"
    _tracing = level == "trace"
    _debugging = level.lower() in ("trace", "debug")
    _configured = (level, fmt)
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _trace_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    factory: Callable[..., Any]
    if fmt == "journal":
        processors.append(journal_datagram)
        factory = JournalLogger.factory(os.environ.get(JOURNAL_SOCKET_ENV, JOURNAL_SOCKET))
    else:
        renderer = (
            structlog.dev.ConsoleRenderer(colors=False) if fmt == "console" else structlog.processors.JSONRenderer()
        )
        processors.append(renderer)
        # One write per line: a worker runs unbuffered, and print() would write the newline separately,
        # letting another process's line land in between (they share the leader's stderr).
        factory = structlog.WriteLoggerFactory(file=sys.stderr)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if _tracing else getattr(logging, level.upper())
        ),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
    _bound_library_logs()
    structlog.contextvars.clear_contextvars()
    if bound:
        structlog.contextvars.bind_contextvars(**bound)
    if _native_stderr is not None:
        _native_stderr.start()
    return fmt


class RateLimit(logging.Filter):
    """Lets through at most ``burst`` records a second with the same logger and message; says how many it dropped.

    For what libraries log through ``logging`` (asyncio, uvicorn): a failure that
    repeats, such as accept() out of descriptors, would otherwise write a
    traceback per retry.
    """

    def __init__(self, burst: int = 5, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.clock = clock
        self.windows: dict[tuple[str, str], tuple[int, int, int]] = {}  # key -> (second, passed, dropped)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        second = int(self.clock())
        window, passed, dropped = self.windows.get(key, (second, 0, 0))
        if window != second:
            if dropped:
                record.msg = f"{record.msg} ({dropped} more like this were not logged)"
            window, passed, dropped = second, 0, 0
        if passed >= self.burst:
            self.windows[key] = (window, passed, dropped + 1)
            return False
        if len(self.windows) > 1000:  # many different messages: forget the old windows
            self.windows.clear()
        self.windows[key] = (window, passed + 1, dropped)
        return True


def _bound_library_logs() -> None:
    """Library records (``logging``: uvicorn's; and ``warnings``, a library's) become entries of ours, through
    ``RateLimit``: a plain line would break a JSON log."""
    root = logging.getLogger()
    if root.handlers:  # configured already, by an earlier call or by a host program such as pytest
        return
    handler = LibraryRecords()
    handler.setLevel(logging.WARNING)  # what logging's last-resort handler wrote
    handler.addFilter(RateLimit())
    root.addHandler(handler)
    logging.captureWarnings(True)  # a library's ``warnings.warn`` too, which would print a plain line


def adopt_library_logger(name: str) -> None:
    """Make the records of a library that writes them through a handler of its own (transformers: a plain
    ``[transformers] ...`` line on stderr, which breaks a JSON log) entries of ours: its stream handlers go, and its
    records pass up to the root's ``LibraryRecords``. Call it once the library is imported: it adds its handler then,
    and never again."""
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        if isinstance(handler, logging.StreamHandler):
            logger.removeHandler(handler)
    logger.propagate = True


class LibraryRecords(logging.Handler):
    """A library's record as an entry in this process's format, its logger's name in ``logger`` and its traceback
    (uvicorn's "Exception in ASGI application") in ``exception``."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            logger = structlog.get_logger(record.name)
            fields: dict[str, Any] = {"logger": record.name}
            if record.exc_info:
                fields["exc_info"] = record.exc_info
            getattr(logger, record.levelname.lower(), logger.warning)(record.getMessage(), **fields)
        except Exception:  # noqa: BLE001 - logging's own way: a record that cannot be written never raises
            self.handleError(record)


def trace(logger: Any, event: str, **fields: object) -> None:
    """Log below debug: per-step detail, too much for anything but chasing a problem."""
    if _tracing:
        logger.debug(event, _trace=True, **fields)


def ms_since(started: float) -> float:
    """Milliseconds since a ``time.perf_counter()`` reading, as logs show durations."""
    return round((time.perf_counter() - started) * 1000, 1)


def _trace_level(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    if event.pop("_trace", False):
        event["level"] = "trace"
    return event


def stderr_is_journal() -> bool:
    """systemd sets ``$JOURNAL_STREAM`` to ``device:inode`` of the stream it connected; a redirect changes them."""
    try:
        device, inode = (int(part) for part in os.environ["JOURNAL_STREAM"].split(":"))
        stat = os.fstat(sys.stderr.fileno())
    except (KeyError, ValueError, OSError):
        return False
    return (stat.st_dev, stat.st_ino) == (device, inode)


_FIELD_NAME = re.compile(r"[^A-Z0-9_]")


def journal_datagram(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> bytes:
    """One journal entry: MESSAGE reads like a console line, and every key is also a field of its own."""
    level = str(event.pop("level", "info"))
    event.pop("timestamp", None)  # the journal stamps entries itself
    message = str(event.pop("event", ""))
    extra = " ".join(f"{key}={value}" for key, value in event.items() if key != "exception")
    fields: dict[str, object] = {
        "MESSAGE": f"{message} {extra}" if extra else message,
        "PRIORITY": PRIORITIES.get(level, 6),
        "SYSLOG_IDENTIFIER": SYSLOG_IDENTIFIER,
        "EVENT": message,  # journalctl EVENT="request done": MESSAGE also holds the fields
        "LEVEL": level,
    }
    for key, value in event.items():
        # Field names are upper-case letters, digits and underscores, not starting with one.
        name = _FIELD_NAME.sub("_", key.upper()).lstrip("_")[:64]
        if name and name not in fields:
            fields[name] = value
    out = bytearray()
    for name, value in fields.items():
        data = str(value).encode()
        if b"\n" in data:
            out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name.encode() + b"=" + data + b"\n"
    return bytes(out)


class JournalLogger:
    """Sends each rendered entry to the journal; if the journal refuses it, the line goes to stderr instead."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    @classmethod
    def factory(cls, path: str) -> Callable[..., JournalLogger]:
        shared = cls(path)
        return lambda *_args: shared

    def msg(self, entry: bytes) -> None:
        try:
            self._socket.sendto(entry, self._path)
        except OSError:
            # Too large for a datagram, or no journal: nothing is lost, stderr still reaches it.
            sys.stderr.write(entry.decode(errors="replace").replace("\n", " ") + "\n")

    debug = info = warning = error = critical = exception = log = msg


class NativeStderr:
    """Takes file descriptor 2 from native code: what MLX's C++ writes there (``[ring] Socket 16 failed with errno
    32``, in pieces, from its own threads) comes back as ``native output`` entries, one per line.

    Why: the logger and native code shared one stderr, so a piece could land inside a JSON line and break it. Now
    descriptor 2 is a pipe that a thread reads; ``sys.stderr``, which the logger writes to, is a copy of the real
    stderr (the same journald stream under systemd, so ``stderr_is_journal`` still holds). ``release`` puts
    descriptor 2 back before an exec or an exit and relays what the pipe still holds: the thread never has to
    outlive the process, and a writer never blocks on a pipe nobody reads. A process killed outright (SIGKILL,
    abort) loses what the thread had not read yet.
    """

    LONGEST = 64 * 1024  # a line without its end, relayed in parts, so that a runaway writer cannot grow memory

    def __init__(self) -> None:
        sys.stderr.flush()
        self.real = os.dup(2)  # not inheritable: children are handed it by name (``sys.stderr``)
        self._read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._stop_read, self._stop_write = os.pipe()
        self._released = False
        self._lock = threading.Lock()
        sys.stderr = open(self.real, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
        for handler in logging.getLogger().handlers:  # library records too go to the real stderr
            if isinstance(handler, logging.StreamHandler):
                with contextlib.suppress(AttributeError, ValueError, OSError):
                    if handler.stream.fileno() == 2:
                        handler.setStream(sys.stderr)
        self._thread: threading.Thread | None = None
        atexit.register(self.release)

    def start(self) -> None:
        """Start relaying, once the logger is configured; the entries carry the fields bound by then (``rank=0``),
        as a thread starts with no context of its own."""
        if self._thread is None:
            run = contextvars.copy_context().run
            self._thread = threading.Thread(target=run, args=(self._run,), name="neuron-stderr", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        logger = structlog.get_logger("neuron.mlx")
        pending = b""
        stopping = False
        while True:
            if not stopping:
                ready, _, _ = select.select([self._read, self._stop_read], [], [])
                stopping = self._stop_read in ready
                if stopping:  # descriptor 2 is the real one again: read what is left without waiting
                    os.set_blocking(self._read, False)
            try:
                chunk = os.read(self._read, 65536)
            except BlockingIOError:
                chunk = b""
            pending += chunk
            *lines, pending = pending.split(b"\n")
            while len(pending) > self.LONGEST:
                lines.append(pending[: self.LONGEST])
                pending = pending[self.LONGEST :]
            if not chunk and pending:  # the end of it: a piece without its newline is still a line
                lines.append(pending)
                pending = b""
            for raw in lines:
                if line := raw.decode(errors="replace").rstrip():
                    logger.warning("native output", line=line)
            if not chunk:
                os.close(self._read)  # a writer left holding descriptor 2 (a child) fails rather than blocks
                return

    def release(self, timeout: float = 2.0) -> None:
        """Give descriptor 2 back to the real stderr and relay what the pipe holds. Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
            os.dup2(self.real, 2)  # native writes from now on go straight out; the pipe's last writer is gone
            os.write(self._stop_write, b"x")
        if self._thread is None:  # never started: what the pipe holds is read here, before it is lost
            self._run()
        else:
            self._thread.join(timeout)


_native_stderr: NativeStderr | None = None


def release_native_stderr() -> None:
    """Before an exec or ``os._exit``: descriptor 2 back to the real stderr, the pipe's last lines relayed."""
    if _native_stderr is not None:
        _native_stderr.release()


@contextmanager
def progress(label: str, total: int) -> Iterator[Callable[[], None]]:
    """Count work done: a progress bar on a terminal (rich's, erased once done), one log line with the duration
    either way. A single item (a model loading) has no fraction to show: its bar pulses until it is done."""
    started = time.perf_counter()
    done = 0
    bar = _bar(label, total) if sys.stderr.isatty() else None
    with bar or _nothing():

        def advance() -> None:
            nonlocal done
            done += 1
            if bar is not None:
                bar.advance(bar.task_ids[0])

        yield advance
    structlog.get_logger("neuron").info(label, items=done, ms=ms_since(started))


def _bar(label: str, total: int) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    counted = (MofNCompleteColumn(),) if total > 1 else ()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), *counted, TimeElapsedColumn())
    # Not redirecting stdout: it holds generate's answer, and nothing but the answer may reach it.
    bar = Progress(*columns, console=Console(stderr=True), transient=True, redirect_stdout=False)
    bar.add_task(label, total=total if total > 1 else None)
    return bar


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# A library default: until a program configures logging, structlog would print
# to stdout, which is the protocol in a worker and the generated text in the CLI.
if not structlog.is_configured():
    configure("warning", "json")
