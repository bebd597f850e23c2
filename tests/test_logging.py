"""Logs as journald receives them: native fields and priorities, from the leader and from every worker.

A datagram socket stands in for the journal's (``NEURON_JOURNAL_SOCKET``).
"""

from __future__ import annotations

import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import structlog
from conftest import ROOT, DatagramSink, neuron_command, wait_until

from neuron import log


def parse_entry(data: bytes) -> dict[str, str]:
    """One native-protocol datagram: ``KEY=value`` lines, or ``KEY``, a 64-bit length, and a value with newlines."""
    fields: dict[str, str] = {}
    while data:
        end = data.index(b"\n")
        line = data[:end]
        if b"=" in line:
            name, value = line.split(b"=", 1)
            data = data[end + 1 :]
        else:
            (size,) = struct.unpack("<Q", data[end + 1 : end + 9])
            name, value = line, data[end + 9 : end + 9 + size]
            assert data[end + 9 + size : end + 10 + size] == b"\n"
            data = data[end + 10 + size :]
        fields[name.decode()] = value.decode()
    return fields


class Journal(DatagramSink):
    def entries(self, **match: str) -> list[dict[str, str]]:
        parsed = [parse_entry(data) for _, data in list(self.datagrams)]
        return [e for e in parsed if all(e.get(k) == v for k, v in match.items())]

    def one(self, **match: str) -> dict[str, str]:
        found = self.entries(**match)
        assert found, f"no journal entry with {match}"
        return found[0]


@pytest.fixture
def journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Journal]:
    with Journal(tmp_path / "journal") as sink:
        monkeypatch.setenv(log.JOURNAL_SOCKET_ENV, str(sink.path))
        yield sink


@pytest.mark.unit
def test_fields_and_priorities_in_process(journal: Journal) -> None:
    try:
        log.configure("trace", "journal", rank=3)
        logger = structlog.get_logger("test")
        logger.info("request started", request_id="abc", prompt_tokens=5, top_p=0.9)
        logger.warning("slow")
        logger.debug("fan-out", op="generate_step")
        log.trace(logger, "step", ms=1.5)
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            logger.exception("failed", op="load")
        wait_until(lambda: len(journal.datagrams) == 5, 5, "5 journal entries")
    finally:
        log.configure("warning", "json")

    started = journal.one(EVENT="request started")
    assert started["MESSAGE"].startswith("request started ") and "request_id=abc" in started["MESSAGE"]
    assert started["PRIORITY"] == "6" and started["SYSLOG_IDENTIFIER"] == "neuron"
    fields = (started["REQUEST_ID"], started["PROMPT_TOKENS"], started["TOP_P"], started["RANK"])
    assert fields == ("abc", "5", "0.9", "3")
    assert "TIMESTAMP" not in started  # the journal stamps entries itself
    assert journal.one(EVENT="slow")["PRIORITY"] == "4"
    assert journal.one(OP="generate_step")["PRIORITY"] == "7"
    step = journal.one(LEVEL="trace")
    assert (step["PRIORITY"], step["MS"]) == ("7", "1.5")
    failed = journal.one(OP="load")
    assert failed["PRIORITY"] == "3"
    assert "Traceback" in failed["EXCEPTION"] and "boom\nsecond line" in failed["EXCEPTION"]


@pytest.mark.unit
def test_trace_is_off_below_trace_level(journal: Journal) -> None:
    try:
        log.configure("debug", "journal")
        logger = structlog.get_logger("test")
        log.trace(logger, "step")
        logger.debug("shown")
        wait_until(lambda: len(journal.datagrams) == 1, 5, "1 journal entry")
    finally:
        log.configure("warning", "json")
    assert journal.entries(EVENT="step") == []


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
