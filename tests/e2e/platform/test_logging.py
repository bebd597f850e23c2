"""Logs as journald receives them from the leader and from every worker of a real server under systemd's
``$JOURNAL_STREAM``. A datagram socket stands in for the journal's (``NEURON_JOURNAL_SOCKET``); the fields in one
process: tests/unit/test_logging.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from testkit import ROOT, neuron_command, wait_until
from testkit.system import Journal


def test_under_systemd_every_rank_logs_its_fields_to_the_journal(
    tiny_models: dict[str, Path], journal: Journal, tmp_path: Path
) -> None:
    """``$JOURNAL_STREAM`` naming our stderr switches ``auto`` to the journal, in the leader and its workers."""
    stderr_path = tmp_path / "stderr"

    with stderr_path.open("w") as stderr:
        stat = os.fstat(stderr.fileno())
        process = subprocess.Popen(
            neuron_command("serve", "--model", str(tiny_models["qwen3"]), "--tp", "2", "--port", "0"),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            cwd=ROOT,
            env={**os.environ, "JOURNAL_STREAM": f"{stat.st_dev}:{stat.st_ino}", "NEURON_LOG_LEVEL": "trace"},
        )
        try:
            wait_until(lambda: bool(journal.entries(EVENT="serving")) or process.poll() is not None, 120, "serving")
            port = journal.one(EVENT="serving", LEVEL="info", RANK="0", SYSLOG_IDENTIFIER="neuron")["PORT"]
            body = {"model": "qwen3", "prompt": "hello", "max_tokens": 6, "temperature": 0.5, "top_p": 0.75}
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200
            request_id = reply.json()["id"]
            wait_until(lambda: journal.entries(EVENT="request done", REQUEST_ID=request_id), 10, "request done")
        finally:
            process.terminate()
            assert process.wait(timeout=60) == 0
    assert stderr_path.read_text() == ""  # everything went to the journal

    worker = journal.one(RANK="1", EVENT="worker started")
    assert worker["PRIORITY"] == "6" and worker["WORLD_SIZE"] == "2"
    assert journal.one(RANK="1", EVENT="share loaded")
    started = journal.one(EVENT="request started", REQUEST_ID=request_id, RANK="0")
    assert (started["PROMPT_TOKENS"], started["MAX_TOKENS"], started["TEMPERATURE"], started["TOP_P"]) == (
        "5",
        "6",
        "0.5",
        "0.75",
    )
    assert float(journal.one(EVENT="prefill done", REQUEST_ID=request_id)["MS"]) > 0
    decoded = journal.one(EVENT="decode done", REQUEST_ID=request_id)
    assert decoded["TOKENS"] == "6" and float(decoded["MS"]) > 0
    done = journal.one(EVENT="request done", REQUEST_ID=request_id, PRIORITY="6")
    assert done["FINISH_REASON"] == "length" and float(done["MS"]) > 0
    for event in ("fan-out", "rank 0 forward", "drain", "kv cache cleared"):
        assert journal.one(EVENT=event, PRIORITY="7", LEVEL="debug"), event
    assert journal.one(EVENT="drain", OP="generate_step")["ERRORS"] == "0"
    steps = journal.entries(EVENT="step", LEVEL="trace", PRIORITY="7")
    assert len(steps) >= 6 and all(float(s["MS"]) > 0 for s in steps)


# A leader in small: a thread writes to descriptor 2 at the C level, in pieces as MLX's std::cerr does, while the
# main thread logs; then the process ends the way the leader does, normally or through os._exit.
NATIVE_WRITER = """
import logging, os, sys, threading, warnings
import structlog
from neuron import log

ending, fmt = sys.argv[1:]
log.configure("info", fmt, native_stderr=True, rank=0)
logger = structlog.get_logger("test")

def native() -> None:
    for i in range(300):
        os.write(2, b"[ring] Socket ")
        os.write(2, str(i).encode())
        os.write(2, b" failed with errno 32\\n")
    os.write(2, b"last words without a newline")

writer = threading.Thread(target=native)
writer.start()
ticks = 0
while writer.is_alive() or ticks < 300:
    logger.info("tick", i=ticks)
    ticks += 1
writer.join()
try:  # a library's record with its traceback, as uvicorn logs an exception in a route
    raise ValueError("boom")
except ValueError:
    logging.getLogger("uvicorn.error").exception("Exception in ASGI application")
warnings.warn("a library's warning", UserWarning, stacklevel=1)
print(ticks)
if ending == "os._exit":
    log.release_native_stderr()
    os._exit(0)
"""
NATIVE_LINES = [*(f"[ring] Socket {i} failed with errno 32" for i in range(300)), "last words without a newline"]


def _native_writer(ending: str, fmt: str) -> tuple[int, str]:
    """Run it; the ticks it logged, and its stderr."""
    argv = [sys.executable, "-c", textwrap.dedent(NATIVE_WRITER), ending, fmt]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return int(done.stdout), done.stderr


@pytest.mark.parametrize("ending", ["return", "os._exit"])
def test_native_writes_to_stderr_are_entries_of_their_own(ending: str) -> None:
    """What native code writes to descriptor 2 never breaks a JSON line, and every line of it is relayed."""
    ticks, stderr = _native_writer(ending, "json")
    entries = [json.loads(line) for line in stderr.splitlines()]  # every line is one whole entry
    assert [entry["line"] for entry in entries if entry["event"] == "native output"] == NATIVE_LINES
    assert all(entry["rank"] == 0 and entry["level"] == "warning" for entry in entries if "line" in entry)
    assert [entry["i"] for entry in entries if entry["event"] == "tick"] == list(range(ticks))
    library = [entry for entry in entries if entry.get("logger") == "uvicorn.error"]
    assert len(library) == 1 and library[0]["event"] == "Exception in ASGI application", library
    assert library[0]["level"] == "error" and "ValueError: boom" in library[0]["exception"]
    (warned,) = [entry for entry in entries if entry.get("logger") == "py.warnings"]
    assert "UserWarning: a library's warning" in warned["event"] and warned["level"] == "warning", warned


def test_native_writes_reach_the_journal_as_entries(journal: Journal) -> None:
    """Under systemd the relayed lines are journal entries with their fields, like any other."""
    ticks, stderr = _native_writer("return", "journal")
    assert stderr == ""
    wait_until(lambda: len(journal.datagrams) == ticks + len(NATIVE_LINES) + 2, 10, "every entry in the journal")
    assert [entry["LINE"] for entry in journal.entries(EVENT="native output")] == NATIVE_LINES
    assert {entry["RANK"] for entry in journal.entries(EVENT="native output")} == {"0"}
