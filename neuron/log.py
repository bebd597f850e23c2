"""Logging, configured once per process: JSON lines on stderr, or readable lines on a terminal.

Everything goes to stderr. A worker's stdout is the protocol, and the leader's
is the generated text (``neuron generate``), so no log line may ever reach it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import structlog

LEVELS = ("debug", "info", "warning", "error")


def configure(level: str = "info", fmt: str = "auto", **bound: object) -> None:
    """``fmt`` is ``json``, ``console``, or ``auto`` (console on a terminal, JSON otherwise)."""
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = structlog.dev.ConsoleRenderer(colors=False) if fmt == "console" else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if bound:
        structlog.contextvars.bind_contextvars(**bound)


@contextmanager
def progress(label: str, total: int) -> Iterator[Callable[[], None]]:
    """Count work done: a live line on a terminal, one log line with the duration either way."""
    started = time.perf_counter()
    done = 0
    live = sys.stderr.isatty()
    if live:
        sys.stderr.write(f"{label}: 0/{total}")
        sys.stderr.flush()

    def advance() -> None:
        nonlocal done
        done += 1
        if live:
            sys.stderr.write(f"\r{label}: {done}/{total}")
            sys.stderr.flush()

    yield advance
    if live:
        sys.stderr.write("\n")
    structlog.get_logger("neuron").info(label, items=done, ms=round((time.perf_counter() - started) * 1000, 1))


# A library default: until a program configures logging, structlog would print
# to stdout, which is the protocol in a worker and the generated text in the CLI.
if not structlog.is_configured():
    configure("warning", "json")
