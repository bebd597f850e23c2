"""The bounds on hostile input, decided without a model or a server: how deep and how large a request's JSON may
be, which origins and hosts are answered, the log's rate limit, the descriptor limit, the model cache's publish."""

from __future__ import annotations

import json
import logging
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from neuron.log import RateLimit
from neuron.models.gguf import _publish
from neuron.server.common import limits
from neuron.server.common.limits import LimitError
from neuron.server.guard import Allowed, Guard
from neuron.server.http import EventStream
from neuron.system import descriptors
from testkit.hostile import nested, ref_chain


def test_depth_is_measured_without_recursing_and_fast_on_wide_bodies() -> None:
    assert not limits.too_deep(nested(5), 5) and not limits.too_deep({"x": [nested(4)]}, 6)
    assert limits.too_deep(nested(6), 5) and limits.too_deep({"x": [nested(5)]}, 6)
    assert limits.too_deep(nested(100_000), 100)  # far past Python's recursion limit
    wide = orjson.loads(b"[" + b",".join([b"{}"] * 1_000_000) + b"]")  # about 3 MiB: within the body limit
    started = time.process_time()  # the work, which a loaded machine's wall clock would stretch
    limits.check_body({"model": "m", "messages": wide})
    assert time.process_time() - started < 0.5  # on the event loop: it used to take seconds


def test_a_deep_body_is_refused_naming_its_field() -> None:
    limits.check_body({"model": "m", "metadata": nested(limits.MAX_BODY_DEPTH - 1)})
    with pytest.raises(LimitError) as caught:
        limits.check_body({"model": "m", "metadata": nested(limits.MAX_BODY_DEPTH)})
    assert caught.value.param == "metadata" and f"deeper than {limits.MAX_BODY_DEPTH}" in str(caught.value)
    assert caught.value.code == "too_deep"
    with pytest.raises(LimitError) as caught:
        limits.check_body([nested(200)])
    assert caught.value.param is None


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        (nested(limits.MAX_SCHEMA_DEPTH + 1), "deeper than 64"),
        (ref_chain(limits.MAX_SCHEMA_REFS), "more than 256 different places"),
        ({"enum": list(range(limits.MAX_SCHEMA_NODES))}, "more than 250000 values"),
    ],
    ids=["nesting", "refs", "size"],
)
def test_a_schema_past_a_bound_is_refused_naming_the_field_and_the_bound(schema: Any, says: str) -> None:
    with pytest.raises(LimitError) as caught:
        limits.check_schema(schema, "tools[2].function.parameters")
    assert caught.value.param == "tools[2].function.parameters" and caught.value.code == "unsupported_schema"
    assert says in str(caught.value)


def test_a_schema_within_the_bounds_passes() -> None:
    limits.check_schema(nested(limits.MAX_SCHEMA_DEPTH), "response_format.json_schema.schema")
    limits.check_schema(ref_chain(limits.MAX_SCHEMA_REFS - 1), "response_format.json_schema.schema")


def test_earlier_tool_call_arguments_are_bounded_and_non_json_passes_as_text() -> None:
    assert limits.tool_call_arguments('{"city": "Paris"}', "w") == {"city": "Paris"}
    assert limits.tool_call_arguments("not json", "w") == "not json"
    deep = json.dumps(nested(limits.MAX_ARGUMENTS_DEPTH + 1))
    with pytest.raises(LimitError) as caught:
        limits.tool_call_arguments(deep, "messages[1].tool_calls[0].function.arguments")
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"
    # Deeper than orjson reads: a string, which recurses nowhere.
    assert limits.tool_call_arguments("[" * 5000 + "]" * 5000, "w").startswith("[[")


@pytest.mark.parametrize(
    "metadata",
    [{"a": {"b": "c"}}, {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, ["k"]],
    ids=["nested", "17 pairs", "long key", "long value", "array"],
)
def test_metadata_takes_openais_shape(metadata: Any) -> None:
    limits.check_metadata({f"k{i}": "v" * 512 for i in range(16)})
    with pytest.raises(LimitError) as caught:
        limits.check_metadata(metadata)
    assert caught.value.param.startswith("metadata")


def test_hosts_ip_addresses_loopback_names_and_configured_ones_pass() -> None:
    allowed = Allowed.build(hosts=["api.example.com", "*.internal"], listen="box.lan")
    for host in ("127.0.0.1:8000", "10.1.2.3", "[::1]:8000", "localhost:8000", "a.localhost", "box.lan:80"):
        assert allowed.host(host), host
    for host in ("api.example.com", "x.internal:9"):
        assert allowed.host(host), host
    for host in ("evil.com", "127.0.0.1.evil.com", "localhost.evil.com", "api.example.com.evil.com"):
        assert not allowed.host(host), host
    assert Allowed.build(hosts=["*"]).host("anything.example")


def test_origins_loopback_pages_and_configured_ones_pass() -> None:
    allowed = Allowed.build(origins=["https://*.example.com"])
    for origin in ("http://localhost:5173", "http://127.0.0.1", "https://[::1]:8443", "https://app.example.com"):
        assert allowed.origin(origin), origin
    for origin in ("https://evil.com", "null", "http://localhost.evil.com", "https://example.com.evil.com"):
        assert not allowed.origin(origin), origin


def _scope(headers: dict[str, str], method: str = "POST", path: str = "/v1/chat/completions") -> dict[str, Any]:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return {"type": "http", "method": method, "path": path, "headers": raw}


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"host": "127.0.0.1:8000", "content-type": "application/json"}, None),
        ({"host": "127.0.0.1:8000"}, None),  # curl --data-binary @file: no type, no browser
        ({"host": "127.0.0.1:8000", "content-type": "application/json; charset=utf-8"}, None),
        ({"host": "127.0.0.1:8000", "content-type": "text/plain"}, 415),
        ({"host": "127.0.0.1:8000", "content-type": "application/x-www-form-urlencoded"}, 415),
        ({"host": "rebound.evil.com:8000", "content-type": "application/json"}, 403),
        ({"host": "127.0.0.1", "origin": "https://evil.com", "content-type": "application/json"}, 403),
        ({"host": "127.0.0.1", "origin": "http://localhost:3000", "content-type": "application/json"}, None),
        ({"host": "127.0.0.1", "content-length": "2", "transfer-encoding": "chunked"}, 400),
    ],
)
def test_guard_decisions(headers: dict[str, str], status: int | None) -> None:
    guard = Guard(Starlette(), Allowed.build(), ["/v1/chat/completions"])
    problem = guard.problem(_scope(headers))
    assert (problem[0] if problem else None) == status, problem


def test_guard_leaves_get_routes_without_a_body_alone() -> None:
    guard = Guard(Starlette(), Allowed.build(), ["/v1/chat/completions"])
    assert guard.problem(_scope({"host": "127.0.0.1", "content-type": "text/plain"}, "GET", "/v1/models")) is None


def test_the_rate_limit_passes_a_burst_a_second_per_message_and_counts_the_rest() -> None:
    now = [100.0]
    limit = RateLimit(burst=3, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    passed = [limit.filter(record("accept failed")) for _ in range(1000)]
    assert sum(passed) == 3
    assert limit.filter(record("another failure"))  # another message has its own burst
    now[0] += 1
    later = record("accept failed")
    assert limit.filter(later) and "997 more like this" in later.getMessage()


def test_the_descriptor_limit_survives_mlx_lm() -> None:
    """In a child: lowering this process's hard limit cannot be undone."""
    code = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 9000))\n"
        "from neuron.system import descriptors\n"
        "descriptors.raise_soft_limit()\n"
        "descriptors.import_mlx_lm()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
        "import mlx_lm.utils, importlib; importlib.reload(mlx_lm.utils)\n"  # unguarded, it lowers the limit
        "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 9000:
        pytest.skip(f"the hard descriptor limit here is {hard}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["(9000, 9000)", "(2048, 4096)"], out.stdout + out.stderr
    with descriptors.limit_kept():
        resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)


def _conversion(root: Path, name: str, marker: str) -> Path:
    staging = root / f".staging-{name}"
    staging.mkdir(parents=True)
    (staging / "config.json").write_text(marker)
    return staging


def test_the_second_conversion_to_finish_uses_the_first_ones_folder(tmp_path: Path) -> None:
    out = tmp_path / "model"
    _publish(_conversion(tmp_path, "a", "first"), out)
    second = _conversion(tmp_path, "b", "second")
    _publish(second, out)  # used to fail: OSError [Errno 39] Directory not empty
    assert (out / "config.json").read_text() == "first" and not second.exists()


def test_a_half_folder_in_the_way_is_replaced(tmp_path: Path) -> None:
    out = tmp_path / "model"
    (out / "partial").mkdir(parents=True)
    _publish(_conversion(tmp_path, "a", "whole"), out)
    assert (out / "config.json").read_text() == "whole" and not (out / "partial").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.mark.anyio
async def test_a_stream_whose_events_fail_ends_with_an_error_event() -> None:
    async def events() -> Any:
        yield b"data: {}\n\n"
        raise RuntimeError("a bug")

    async def route(request: Request) -> Response:
        return EventStream(events(), on_close=lambda: None)

    app = Starlette(routes=[Route("/", route)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        reply = await client.get("/")
    last = reply.text.strip().split("\n\n")[-1]
    assert json.loads(last.removeprefix("data: "))["error"]["code"] == "server_error", reply.text
