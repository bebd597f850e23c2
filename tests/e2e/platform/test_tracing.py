"""Requests traced with OpenTelemetry (``--otlp-traces-endpoint``): a real OTLP/HTTP receiver, which decodes what
the server's exporter sends with OpenTelemetry's own protocol package, gets each request's span, continuing the
client's ``traceparent``, with its queue, prefill and decode, and the step on every rank of a TP=2 group."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from testkit import Server, serving, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP trace receiver on loopback: every span it was sent, with its attributes decoded."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        spans.extend(_decoded(span) for span in scope.spans)
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        return [span for span in self.spans if span["trace_id"] == trace_id]


def _decoded(span: Any) -> dict[str, Any]:
    attributes = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        attributes[kv.key] = (
            [v.string_value for v in value.array_value.values] if kind == "array_value" else getattr(value, kind)
        )
    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent": span.parent_span_id.hex(),
        "start": span.start_time_unix_nano,
        "end": span.end_time_unix_nano,
        "attributes": attributes,
    }


@pytest.fixture(scope="module")
def traced(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Receiver]]:
    receiver = Receiver()
    args = ("--model", str(tiny_models["qwen3"]), "--tp", "2", "--otlp-traces-endpoint", receiver.url)
    # Every step's ranks, and the batch exported at once rather than every 5 s (the SDK's own variable).
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
    with serving(tmp_path_factory, *args, "--trace-step-ratio", "1", env=env) as server:
        yield server, receiver
    receiver.server.shutdown()


def test_a_request_is_traced_from_the_clients_traceparent_with_its_phases_and_every_ranks_steps(
    traced: tuple[Server, Receiver],
) -> None:
    server, receiver = traced
    body = {"model": "qwen3", "prompt": "The keeper climbs", "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    wait_until(lambda: any(s["parent"] == PARENT_ID for s in receiver.trace(TRACE_ID)), 30, "the request's span")
    spans = receiver.trace(TRACE_ID)
    (request,) = [s for s in spans if s["parent"] == PARENT_ID]  # the client's span is the root
    assert request["name"] == "text_completion qwen3"
    assert request["attributes"]["gen_ai.operation.name"] == "text_completion"
    assert request["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert request["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    children = [s for s in spans if s["parent"] == request["span_id"]]
    phases = {s["name"]: s for s in children if s["name"] != "step"}
    assert set(phases) == {"queue", "prefill", "decode"}, phases
    assert (
        phases["queue"]["end"] <= phases["prefill"]["start"] + 1
        and phases["prefill"]["end"] <= phases["decode"]["start"] + 1
    )
    assert phases["decode"]["attributes"]["gen_ai.usage.output_tokens"] == 5
    steps = [s for s in children if s["name"] == "step"]
    assert {s["attributes"]["neuron.rank"] for s in steps} == {0, 1}  # every rank of the group
    assert all(request["start"] <= s["start"] <= s["end"] <= request["end"] for s in children)
    # The trace id is in the request's log entries.
    assert server.find_log("request done", trace_id=TRACE_ID) is not None


def test_without_a_traceparent_a_request_starts_a_trace_of_its_own(traced: tuple[Server, Receiver]) -> None:
    server, receiver = traced
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    wait_until(lambda: any(s["name"] == "chat qwen3" for s in receiver.spans), 30, "the chat's span")
    (chat,) = [s for s in receiver.spans if s["name"] == "chat qwen3"]
    assert chat["parent"] == "" and chat["trace_id"] != TRACE_ID


def test_an_unreachable_collector_costs_the_requests_nothing_and_is_said_once(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Nothing listens where the traces go: every request is answered, the exporter's failures (a batch every
    100 ms) are logged once, not once a batch, and the server still stops at once on SIGTERM."""
    with socket.socket() as closed:  # a port bound, then released: nothing listens there
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    args = ("--model", str(tiny_models["qwen3"]), "--otlp-traces-endpoint", f"http://127.0.0.1:{port}/v1/traces")
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
    with serving(tmp_path_factory, *args, env=env) as server:
        for _ in range(6):
            body = {"model": "qwen3", "prompt": "hello", "max_tokens": 4}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        wait_until(lambda: _export_failures(server) >= 1, 30, "the exporter's failure in the log")
        for _ in range(3):  # more batches fail, and are not said again within the minute
            body = {"model": "qwen3", "prompt": "hello again", "max_tokens": 4}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 10  # serving() waited for its exit 0: no retry held the stop back
    assert _export_failures(server) == 1, [e for e in server.logs() if e.get("level") in ("warning", "error")]


def _export_failures(server: Server) -> int:
    return sum(
        1
        for entry in server.logs()
        if entry.get("level") in ("warning", "error") and "export" in str(entry.get("event", "")).lower()
    )
