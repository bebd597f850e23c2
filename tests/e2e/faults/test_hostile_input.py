"""Hostile input, second round (issue 27), against a real server subprocess: `$ref` chains that used to fault the
leader, nesting that used to answer 500, browsers' requests, ambiguous framing, and thousands of idle
connections against a kept descriptor limit.

The bounds themselves are decided in tests/e2e/faults/test_limits.py, without a server.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testkit import Server, alive, serving, sse_events, wait_until
from testkit.hostile import nested, ref_chain

ASK = [{"role": "user", "content": "hi"}]
CHAT = {"model": "qwen3", "messages": ASK, "max_tokens": 4}
HEADER_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ("--model", str(tiny_models["qwen3"]), "--max-context", "128", "--header-timeout", str(HEADER_TIMEOUT))
    args += ("--allowed-origins", "https://*.example.com", "--allowed-hosts", "neuron.test")
    with serving(tmp_path_factory, *args) as s:
        yield s


def _post(server: Server, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _post_deep(server: Server, path: str, body: Any, levels: int) -> httpx.Response:
    """``body`` with its string "DEEP" replaced by objects nested ``levels`` deep: past what json.dumps writes."""
    text = json.dumps(body).replace('"DEEP"', '{"a": ' * levels + "1" + "}" * levels)
    return httpx.post(f"{server.url}{path}", content=text, headers={"content-type": "application/json"}, timeout=60)


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _tool(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _refused(reply: httpx.Response, status: int, param: str | None, says: str) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"], error


def _still_serving(server: Server) -> None:
    assert alive(server.process.pid)
    assert _post(server, "/v1/chat/completions", CHAT).status_code == 200


def test_a_ref_chain_through_thousands_of_defs_is_a_400_and_the_leader_lives(server: Server) -> None:
    """It used to end the leader with a segmentation fault inside the grammar compiler."""
    chain = ref_chain(3000)
    reply = _post(server, "/v1/chat/completions", {**CHAT, "response_format": _format(chain)})
    _refused(reply, 400, "response_format", "`response_format.json_schema.schema` refers (`$ref`) to more than 256")
    tools = {**CHAT, "tools": [_tool(chain)], "tool_choice": "required"}
    _refused(_post(server, "/v1/chat/completions", tools), 400, "tools[0].function.parameters", "$ref")
    text = {"type": "json_schema", "name": "answer", "schema": chain}
    responses = {"model": "qwen3", "input": "hi", "max_output_tokens": 4, "text": {"format": text}}
    _refused(_post(server, "/v1/responses", responses), 400, "text.format", "`text.format.schema` refers")
    responses = {"model": "qwen3", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": chain}]}
    _refused(_post(server, "/v1/responses", responses), 400, "tools[0].parameters", "$ref")
    _still_serving(server)


def test_the_deepest_schema_within_the_bounds_compiles_on_the_grammars_stack(server: Server) -> None:
    """255 definitions, each 61 levels deep, chained: the most recursion the bounds let through."""
    defs = {f"d{i}": _wrapped({"$ref": f"#/$defs/d{i + 1}"}, 20) for i in range(255)}
    schema = {"$ref": "#/$defs/d0", "$defs": {**defs, "d255": {"type": "integer"}}}
    started = time.monotonic()
    reply = _post(server, "/v1/chat/completions", {**CHAT, "response_format": _format(schema)})
    assert reply.status_code in (200, 400), reply.text
    assert time.monotonic() - started < 30
    _still_serving(server)


def _wrapped(schema: dict[str, Any], levels: int) -> dict[str, Any]:
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_deep_nesting_is_a_400_naming_the_field(server: Server) -> None:
    """Each of these used to answer 500 (a RecursionError, or orjson failing to write the reply)."""
    arguments = '{"a": ' * 900 + "1" + "}" * 900
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}]
    reply = _post(server, "/v1/chat/completions", {**CHAT, "messages": messages})
    _refused(reply, 400, "messages[1].tool_calls[0].function.arguments", "deeper than 64")

    default = {"type": "object", "properties": {"x": {"type": "object", "default": "DEEP"}}}
    body = {**CHAT, "tools": [_tool(default)], "tool_choice": "none"}
    _refused(_post_deep(server, "/v1/chat/completions", body, 1000), 400, "tools", "deeper than 100")
    default = {"type": "object", "properties": {"x": {"type": "object", "default": nested(80)}}}
    body = {**CHAT, "tools": [_tool(default)], "tool_choice": "none"}
    _refused(_post(server, "/v1/chat/completions", body), 400, "tools[0].function.parameters", "deeper than 64")

    for stream in (False, True):
        body = {"model": "qwen3", "input": "hi", "max_output_tokens": 4, "stream": stream, "metadata": "DEEP"}
        _refused(_post_deep(server, "/v1/responses", body, 300), 400, "metadata", "deeper than 100")
        body["metadata"] = {"k": {"nested": "v"}}
        _refused(_post(server, "/v1/responses", body), 400, "metadata.k", "string values")
    body = {"model": "qwen3", "input": "hi", "max_output_tokens": 4, "metadata": {"k": "v"}}
    assert _post(server, "/v1/responses", body).json()["metadata"] == {"k": "v"}
    _still_serving(server)


def test_streams_end_with_done_or_an_error_event(server: Server) -> None:
    for path, body in (
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/completions", {"model": "qwen3", "prompt": "x", "max_tokens": 4, "stream": True}),
    ):
        with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as reply:
            assert list(sse_events(reply))[-1] == "[DONE]"
    body = {"model": "qwen3", "input": "hi", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60) as reply:
        events = [e for e in sse_events(reply) if isinstance(e, dict)]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


def test_browsers_are_refused_unless_their_origin_and_host_are_allowed(server: Server) -> None:
    # A page's text/plain POST needs no CORS preflight: it must not run the model.
    plain = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=json.dumps(CHAT),
        timeout=60,
        headers={"content-type": "text/plain"},
    )
    assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type", plain.text
    _refused(_post(server, "/v1/chat/completions", CHAT, origin="https://evil.com"), 403, None, "allowed_origins")
    # DNS rebinding: the page's own name, resolved to 127.0.0.1.
    _refused(_post(server, "/v1/models", CHAT, host="rebound.evil.com"), 403, None, "allowed_hosts")
    rebound = httpx.get(f"{server.url}/metrics", headers={"host": f"rebound.evil.com:{server.port}"})
    assert rebound.status_code == 403
    for headers in (
        {"origin": f"http://localhost:{server.port}"},
        {"origin": "https://app.example.com"},
        {"host": "neuron.test"},
        {"host": f"localhost:{server.port}"},
    ):
        reply = _post(server, "/v1/chat/completions", CHAT, **headers)
        assert reply.status_code == 200, (headers, reply.text)
    allowed = _post(server, "/v1/chat/completions", CHAT, origin="https://app.example.com")
    assert allowed.headers["access-control-allow-origin"] == "https://app.example.com"
    preflight = httpx.options(
        f"{server.url}/v1/chat/completions",
        headers={
            "origin": "https://app.example.com",
            "access-control-request-method": "POST",
            "access-control-request-headers": "content-type",
        },
    )
    assert (
        preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://app.example.com"
    )


def _raw(server: Server, request: bytes) -> bytes:
    """Send ``request`` and read until the server closes the connection (or 10 s pass)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_a_request_framed_two_ways_is_refused_and_its_connection_closed(server: Server) -> None:
    body = json.dumps(CHAT).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    started = time.monotonic()
    answer = _raw(server, head + chunked)  # returns only once the server closed the connection
    assert answer.startswith(b"HTTP/1.1 400 ") and b"ambiguous_framing" in answer, answer[:300]
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        # A head still unfinished past h11's buffer for one (16 KiB): 431, not its plain-text 400. (A whole head
        # that arrives at once is read whatever its size.)
        (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 20_000, 431, "headers_too_large"),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: gzip\r\n\r\n",
            501,
            "unsupported_transfer_encoding",
        ),
        (b"GET /health HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n", 400, "invalid_http"),  # a header line with no colon
    ],
    ids=["oversized head", "transfer coding", "malformed header"],
)
def test_what_the_http_parser_refuses_gets_the_json_error_body_and_the_connection_closes(
    server: Server, request_bytes: bytes, status: int, code: str
) -> None:
    answer = _raw(server, request_bytes)  # returns only once the server closed the connection
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()) and b"content-type: application/json" in head, answer
    error = json.loads(body)["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"], error
    assert alive(server.process.pid) and httpx.get(f"{server.url}/health").status_code == 200


def test_a_request_head_that_does_not_finish_in_time_is_answered_408_and_closed(server: Server) -> None:
    started = time.monotonic()
    answer = _raw(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert HEADER_TIMEOUT * 0.9 < time.monotonic() - started < HEADER_TIMEOUT + 5
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as silent:
        assert silent.recv(100) == b""  # nothing sent, nothing said: closed


def test_max_tokens_past_the_context_is_capped_to_what_is_left(server: Server) -> None:
    body = {"model": "qwen3", "prompt": "x" * 20, "max_tokens": 10**9, "ignore_eos": True}
    reply = _post(server, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["total_tokens"] == 128 and reply.json()["choices"][0]["finish_reason"] == "length", usage


# Schemas from plain to hostile: nested, wide, and `$ref` chains and loops through `$defs`, mixed with the
# keywords the grammar compiler recurses on.
leaf = st.sampled_from(
    [{"type": "integer"}, {"type": "string"}, {"type": "boolean"}, {"enum": ["a", "b"]}, {}, {"type": "null"}]
)


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(lambda c: {"type": "array", "items": c}, children),
        st.builds(
            lambda cs: {"type": "object", "properties": {f"p{i}": c for i, c in enumerate(cs)}},
            st.lists(children, min_size=1, max_size=4),
        ),
        st.builds(lambda cs: {"anyOf": cs}, st.lists(children, min_size=1, max_size=3)),
        st.builds(lambda cs: {"allOf": cs}, st.lists(children, min_size=1, max_size=2)),
    )


@st.composite
def schemas(draw: st.DrawFn) -> dict[str, Any]:
    body = draw(st.recursive(leaf, _extend, max_leaves=20))
    depth = draw(st.sampled_from([0, 10, 40, 70]))  # around the nesting bound
    links = draw(st.sampled_from([0, 3, 200, 300, 2000]))  # around the `$ref` bound
    loop = draw(st.booleans())
    for _ in range(depth):
        body = {"type": "object", "properties": {"a": body}}
    if not links:
        return body
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, body]} for i in range(links)}
    defs[f"d{links}"] = {"$ref": "#/$defs/d0"} if loop else body
    return {"$ref": "#/$defs/d0", "$defs": defs}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas(), as_tool=st.booleans())
def test_any_schema_gets_an_answer_in_bounded_time_and_the_server_lives(
    server: Server, schema: dict[str, Any], as_tool: bool
) -> None:
    if as_tool:
        body = {**CHAT, "tools": [_tool({"type": "object", "properties": {"x": schema}})], "tool_choice": "required"}
    else:
        body = {**CHAT, "response_format": _format(schema)}
    started = time.monotonic()
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200 or 400 <= reply.status_code < 500, reply.text
    assert time.monotonic() - started < 20
    assert alive(server.process.pid)


# Descriptors and idle connections.

HARD = 8192  # above the 4096 that importing mlx_lm.utils used to leave


def _limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no descriptor limit in /proc")


@pytest.fixture(scope="module")
def guarded(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two ranks started with a soft descriptor limit of 1,024 under a hard one of 8,192, as systemd's
    LimitNOFILE=1024:8192 would; connections capped well below the thousands the test opens."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < HARD:
        pytest.skip(f"the hard descriptor limit here is below {HARD}")
    args = ("--model", str(tiny_models["qwen3"]), "--tp", "2", "--max-connections", "500")
    args += ("--header-timeout", "30", "--keep-alive-timeout", "30")
    with serving(tmp_path_factory, *args, nofile=(1024, HARD)) as s:
        yield s


def test_the_operators_descriptor_limit_is_kept_and_raised_to_its_hard_limit(guarded: Server) -> None:
    assert _limits(guarded.process.pid) == (HARD, HARD)
    worker = Path(f"/proc/{guarded.process.pid}/task/{guarded.process.pid}/children").read_text().split()
    assert worker and all(_limits(int(pid)) == (HARD, HARD) for pid in worker)


def test_thousands_of_idle_connections_lock_no_client_out_and_the_log_stays_short(guarded: Server) -> None:
    idle: list[socket.socket] = []
    try:
        for i in range(3000):
            s = socket.create_connection(("127.0.0.1", guarded.port), timeout=10)
            if i % 2:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # half a head, never finished
            idle.append(s)
        started = time.monotonic()
        reply = httpx.post(f"{guarded.url}/v1/chat/completions", json=CHAT, timeout=30)
        assert reply.status_code == 200, reply.text
        assert time.monotonic() - started < 5
        wait_until(lambda: guarded.find_log("connection limit reached") is not None, 10, "the limit's log line")
    finally:
        for s in idle:
            s.close()
    assert len(guarded.stderr().splitlines()) < 100, guarded.stderr()[-3000:]
    assert guarded.find_log("connection limit reached")["max_connections"] == 500


def test_processes_converting_the_embedded_model_at_once_share_one_folder(tmp_path: Path) -> None:
    """Hosts sharing a home over NFS, or started from one HOME: the second used to fail on the final rename."""
    code = (
        "from neuron import log\n"
        "log.configure('info', 'json')\n"
        "from neuron.models.folder import resolve\n"
        "print(resolve(None))\n"
    )
    env = {**os.environ, "NEURON_CACHE_DIR": str(tmp_path)}
    command = [sys.executable, "-c", code]
    processes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in processes]
    assert all(p.returncode == 0 for p in processes), [err[-2000:] for _, err in results]
    folders = {out.strip() for out, _ in results}
    assert len(folders) == 1 and (Path(folders.pop()) / "config.json").is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [Path(results[0][0].strip()).name]  # no leftovers
    # They did race: every one converted, and those that finished later used the first one's folder.
    stderr = "".join(err for _, err in results)
    assert stderr.count('"gguf converted meanwhile by another process') >= 1, stderr[-3000:]


def test_a_connection_past_the_limit_when_none_is_idle_gets_a_503(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = ("--model", str(tiny_models["qwen3"]), "--max-connections", "2")
    with serving(tmp_path_factory, *args) as tight:
        body = {"model": "qwen3", "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as first, httpx.Client(timeout=60) as second:
            with (
                first.stream("POST", f"{tight.url}/v1/completions", json=body) as a,
                second.stream("POST", f"{tight.url}/v1/completions", json=body) as b,
            ):
                assert a.status_code == b.status_code == 200
                refused = httpx.get(f"{tight.url}/v1/models", timeout=10)
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "too_many_connections"
        wait_until(lambda: httpx.get(f"{tight.url}/health").status_code == 200, 30, "a place free again")
