"""Logs as journald receives them, in this process: native fields and priorities, and trace off below its level.
A datagram socket stands in for the journal's (``NEURON_JOURNAL_SOCKET``); from the leader and every worker of a
real server: tests/e2e/platform/test_logging.py."""

from __future__ import annotations

import io
import logging

import pytest
import structlog

from neuron import log
from testkit import wait_until
from testkit.system import Journal


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


def test_an_adopted_librarys_records_leave_its_own_handler_for_ours(caplog: pytest.LogCaptureFixture) -> None:
    # transformers writes its warnings through a stream handler of its own, not passed up: a plain line in a JSON log.
    library = logging.getLogger("a_library")
    own = io.StringIO()
    library.addHandler(logging.StreamHandler(own))
    library.propagate = False
    try:
        log.adopt_library_logger("a_library")
        logging.getLogger("a_library.config").warning("the factor does not match")
    finally:
        library.propagate = True
    assert own.getvalue() == ""
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("a_library.config", "the factor does not match")]
