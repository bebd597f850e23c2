"""Logs as journald receives them from the leader and from every worker of a real server under systemd's
``$JOURNAL_STREAM``. A datagram socket stands in for the journal's (``NEURON_JOURNAL_SOCKET``); the fields in one
process: tests/unit/test_logging.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx

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
