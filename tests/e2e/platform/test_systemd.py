"""``neuron serve`` under systemd's protocols, with the test standing in for systemd.

The test owns the notification socket (``NOTIFY_SOCKET``) and the listening
socket (socket activation), as systemd would; everything else is the real
server with real workers.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from testkit import Server, alive, sse_events, wait_until
from testkit.server import sigterm_mid_stream
from testkit.system import FakeSystemd

COMPLETIONS = "/v1/completions"


@contextmanager
def fake_systemd(tmp_path: Path) -> Iterator[FakeSystemd]:
    with FakeSystemd(tmp_path / "notify") as systemd:
        yield systemd


def _worker_pids(server: Server) -> list[int]:
    return [e["pid"] for e in server.logs() if e.get("event") == "worker started"]


def _supervised(tiny_models: dict[str, Path], tmp_path: Path, systemd: FakeSystemd) -> Server:
    """A TP=2 server as systemd starts it, with ``WatchdogSec=1``."""
    env = {"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "1000000"}
    return Server("--model", str(tiny_models["qwen3"]), "--tp", "2", log_path=tmp_path / "log", env=env)


def test_ready_status_watchdog_a_wedged_step_then_stopping(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """One supervised server through its life (one start for what were two tests). It catches: READY sent before the
    probe went through every rank, or no loading status; heartbeats missing or late once ready, or no idle status;
    heartbeats that go on while a worker frozen mid-stream (SIGSTOP) holds the step (systemd would not restart us),
    or that do not come back once it goes on; no running status; SIGTERM cutting the running stream, no STOPPING,
    an exit other than 0, a worker left behind."""
    with fake_systemd(tmp_path) as systemd:
        server = _supervised(tiny_models, tmp_path, systemd)
        try:
            wait_until(lambda: systemd.seen("READY=1"), 120, "READY=1")
            # READY comes only once the probe went through every rank.
            assert server.find_log("ready", world_size=2) is not None
            assert any(s.startswith("loading the model: qwen3 on 2 rank(s)") for s in systemd.statuses())
            server.start()
            ready_at = systemd.seen("READY=1")[0]
            wait_until(lambda: len([t for t in systemd.seen("WATCHDOG=1") if t > ready_at]) >= 4, 10, "4 heartbeats")
            beats = [t for t in systemd.seen("WATCHDOG=1") if t > ready_at]
            assert max(b - a for a, b in itertools.pairwise(beats)) < 0.9  # every quarter of WatchdogSec, loosely
            assert "ready: qwen3 on 2 rank(s), 0 running, 0 waiting" in systemd.statuses()
            workers = _worker_pids(server)
            assert len(workers) == 1

            _wedge_a_step(server, systemd, workers[0])

            body = {"model": "qwen3", "prompt": "hello", "max_tokens": 400, "temperature": 0.0, "stream": True}
            asked_at = time.monotonic()
            with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=body, timeout=60) as response:
                events = sse_events(response)
                next(events)
                running = "ready: qwen3 on 2 rank(s), 1 running, 0 waiting"
                wait_until(lambda: running in systemd.statuses(since=asked_at), 10, running)
                server.process.send_signal(signal.SIGTERM)
                rest = list(events)
            assert rest[-1] == "[DONE]", rest[-3:]
            assert server.process.wait(timeout=60) == 0
        finally:
            server.stop()
        assert systemd.seen("STOPPING=1"), systemd.messages
        assert systemd.seen("STOPPING=1")[0] > ready_at
        assert not alive(workers[0])


def _wedge_a_step(server: Server, systemd: FakeSystemd, worker: int) -> None:
    """A worker frozen mid-stream (SIGSTOP) holds the step: the heartbeat must stop, so that systemd would restart
    us, and come back once the worker goes on. The stream is then dropped, and the server cancels it."""
    body = {"model": "qwen3", "prompt": "hello", "max_tokens": 1900, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=body, timeout=60) as response:
        events = sse_events(response)
        next(events)
        os.kill(worker, signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            # Beats may go on for up to half of WatchdogSec after the step began, then must cease.
            wait_until(lambda: time.monotonic() - stopped_at > 2.5, 5, "2.5 s of a frozen worker")
            late = [t for t in systemd.seen("WATCHDOG=1") if t > stopped_at + 0.75]
            assert late == [], f"{len(late)} heartbeats while a step was wedged"
        finally:
            os.kill(worker, signal.SIGCONT)
        resumed_at = time.monotonic()
        wait_until(lambda: any(t > resumed_at for t in systemd.seen("WATCHDOG=1")), 5, "heartbeats again")
    dropped_at = time.monotonic()
    idle = "ready: qwen3 on 2 rank(s), 0 running, 0 waiting"
    wait_until(lambda: idle in systemd.statuses(since=dropped_at), 10, f"{idle} once the stream was dropped")


def test_socket_activation_a_restart_refuses_no_connection(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """systemd holds the socket: a request sent while no server runs is answered by the next one."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    body = {"model": "qwen3", "prompt": "hello", "max_tokens": 8, "temperature": 0.0}

    def serve(name: str) -> Server:
        server = Server("--model", str(tiny_models["qwen3"]), log_path=tmp_path / name, listen=listener)
        server.start()
        assert server.port == port and server.find_log("listening", socket="systemd") is not None
        return server

    try:
        first = serve("first")
        try:
            expected = httpx.post(f"{first.url}{COMPLETIONS}", json=body, timeout=60).json()["choices"][0]["text"]
        finally:
            assert first.stop() == 0, first.stderr()

        answers: list[httpx.Response] = []
        client = threading.Thread(
            target=lambda: answers.append(httpx.post(f"http://127.0.0.1:{port}{COMPLETIONS}", json=body, timeout=120))
        )
        client.start()  # connects into the backlog: nothing serves this port right now
        second = serve("second")
        try:
            client.join(timeout=120)
            assert answers and answers[0].status_code == 200
            assert answers[0].json()["choices"][0]["text"] == expected
        finally:
            assert second.stop() == 0, second.stderr()
    finally:
        listener.close()


def test_sigterm_past_the_drain_deadline_ends_the_stream_with_an_error_event(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    server = Server("--model", str(tiny_models["qwen3"]), "--drain-timeout", "0.5", log_path=tmp_path / "log").start()
    try:
        rest = sigterm_mid_stream(server, 1900)
        assert rest and isinstance(rest[-1], dict) and "error" in rest[-1], rest[-3:]
        assert "shutting down" in rest[-1]["error"]["message"]
        assert "[DONE]" not in rest
        rc = server.exit_code()
    finally:
        server.stop()
    assert rc == 0, server.stderr()
    assert server.find_log("drain timed out; failing the requests left") is not None
