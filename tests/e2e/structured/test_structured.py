"""Structured output and tool calls end to end: a real ``neuron serve``, the official openai client (sync and async,
streamed and not), SmolLM2 and a random-weight model; every reply checked with ``jsonschema``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import jsonschema
import openai
import pytest

from testkit import TOOLS_TEMPLATE, Server, serving, with_template
from testkit.tools import WEATHER

SMOL = "SmolLM2-135M-Instruct"
S = {"type": "string", "maxLength": 12}  # bounded, so that even a random model finishes
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    {"type": "object", "properties": {"city": S, "country": S}, "required": ["city", "country"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "email": S},
                "required": ["id"],
            }
        },
        "required": ["user"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "title": S,
            "draft": {"type": "boolean"},
            "pages": {"type": "integer", "minimum": 1, "maximum": 500},
        },
        "required": ["title"],
    },
    {"type": "object", "properties": {"status": {"const": "done"}, "note": S}, "required": ["status"]},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "array",
                "items": {"type": "number", "minimum": -1, "maximum": 1},
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "label": S},
        "required": ["level", "label"],
    },
    {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}},
        "required": ["value"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": S}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "exclusiveMinimum": -50, "exclusiveMaximum": 60},
            "unit": {"enum": ["C", "F"]},
        },
        "required": ["temperature", "unit"],
    },
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"]},
    {
        "type": "object",
        "properties": {"yes": {"type": "boolean"}, "no": {"type": "boolean"}, "maybe": {"type": "null"}},
        "required": ["yes", "no"],
    },
    {"enum": ["alpha", "beta", "gamma"]},
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}},
            }
        },
        "required": ["matrix"],
    },
]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def smol(smollm2_server: Server) -> Server:
    return smollm2_server


@pytest.fixture(scope="module")
def tiny(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Its template renders tools, so auto is open to it (SmolLM2's does not).
    model = with_template(tiny_models["qwen3"], tmp_path_factory.mktemp("tools") / "qwen3", TOOLS_TEMPLATE)
    with serving(tmp_path_factory, "--model", str(model), "--prefill-chunk", "16") as server:
        yield server


@pytest.fixture(scope="module")
def tiny_tp2(tiny: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same model split over two ranks: only rank 0 samples, so only it ever sees a constraint."""
    with serving(tmp_path_factory, *tiny.args, "--tp", "2") as server:
        yield server


def _model(server: Server) -> str:
    return "qwen3" if "qwen3" in " ".join(server.args) else SMOL


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def _ask(server: Server, i: int, response_format: dict[str, Any]) -> tuple[str, str]:
    """One of four ways, by ``i``: sync or async client, streamed or not. Returns (text, finish_reason)."""
    args: dict[str, Any] = {
        "model": _model(server),
        "messages": [{"role": "user", "content": f"Answer in JSON. Example {i}: describe something."}],
        "temperature": 0.0,
        "max_tokens": 120,
        "response_format": response_format,
    }
    stream, use_async = i % 2 == 1, i % 4 >= 2
    if use_async:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
            if not stream:
                reply = await client.chat.completions.create(**args)
                return reply.choices[0].message.content or "", reply.choices[0].finish_reason
            chunks = [c async for c in await client.chat.completions.create(**args, stream=True)]
    else:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        if not stream:
            reply = await anyio.to_thread.run_sync(lambda: client.chat.completions.create(**args))
            return reply.choices[0].message.content or "", reply.choices[0].finish_reason
        chunks = await anyio.to_thread.run_sync(lambda: list(client.chat.completions.create(**args, stream=True)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


async def _all(server: Server, formats: list[dict[str, Any]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = [("", "")] * len(formats)

    async def one(i: int) -> None:
        out[i] = await _ask(server, i, formats[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(formats)):
            tg.start_soon(one, i)
    return out


@pytest.mark.parametrize("which", ["smol", "tiny"])
@pytest.mark.anyio
async def test_twenty_schemas_and_json_object_every_reply_validates(which: str, request: pytest.FixtureRequest) -> None:
    server: Server = request.getfixturevalue(which)
    replies = await _all(server, [*map(_format, SCHEMAS), {"type": "json_object"}])
    for schema, (text, reason) in zip(SCHEMAS, replies, strict=False):
        if reason == "length":
            # Only a random model, writing digits of an unbounded fraction: the schemas bound everything else.
            assert which == "tiny" and '"type": "number"' in json.dumps(schema), (schema, text)
            continue
        assert reason == "stop", (schema, text, reason)
        jsonschema.validate(json.loads(text), schema)
    assert sum(reason == "stop" for _, reason in replies[:20]) >= (20 if which == "smol" else 15)
    text, reason = replies[20]  # json_object: any object, so a model may still be inside a string at max_tokens
    assert isinstance(json.loads(text), dict) if reason == "stop" else reason == "length" and text.startswith("{")


@pytest.mark.parametrize("which", ["smol", "tiny"])
def test_completions_take_a_schema_too(which: str, request: pytest.FixtureRequest) -> None:
    server: Server = request.getfixturevalue(which)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    schema = SCHEMAS[1]
    done = client.completions.create(
        model=_model(server),
        prompt="The capital of France, as JSON:",
        temperature=0.0,
        max_tokens=120,
        extra_body={"response_format": _format(schema)},
    )
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].text), schema)


def _arguments(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    return arguments


def test_required_and_named_calls_and_a_round_trip_on_smollm2(smol: Server) -> None:
    client = openai.OpenAI(base_url=f"{smol.url}/v1", api_key="none", max_retries=0)
    common: dict[str, Any] = {"model": SMOL, "temperature": 0.0, "max_tokens": 80, "tools": [WEATHER]}
    required = client.chat.completions.create(messages=ASK, tool_choice="required", **common)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    _arguments(choice.message.tool_calls[0])

    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(messages=ASK, tool_choice=named, stream=True, **common)
    chunks = [c.choices[0] for c in stream if c.choices]
    deltas = [c.delta for c in chunks]
    streamed = [call for d in deltas for call in d.tool_calls or []]
    assert [c.index for c in streamed] == [0] and not "".join(d.content or "" for d in deltas)
    whole = client.chat.completions.create(messages=ASK, tool_choice=named, **common).choices[0]
    assert whole.message.tool_calls and _arguments(streamed[0]) == _arguments(whole.message.tool_calls[0])
    # OpenAI ends a call the request named with "stop", one the model chose with "tool_calls".
    assert whole.finish_reason == "stop" and chunks[-1].finish_reason == "stop"

    call = whole.message.tool_calls[0]
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    answer = client.chat.completions.create(messages=turn, tool_choice="none", **common).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content and not answer.message.tool_calls


def test_auto_shows_the_model_its_tools_and_passes_plain_text_through(tiny: Server) -> None:
    """A random model writes no call: its text arrives whole, streamed or not, and the template saw the tools."""
    client = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="none", max_retries=0)
    common: dict[str, Any] = {"model": "qwen3", "messages": ASK, "temperature": 0.0, "max_tokens": 24}
    plain = client.chat.completions.create(**common)
    whole = client.chat.completions.create(**common, tools=[WEATHER])
    assert whole.usage and plain.usage
    assert whole.usage.prompt_tokens > plain.usage.prompt_tokens + len(json.dumps(WEATHER))  # one token a byte
    chunks = list(client.chat.completions.create(**common, tools=[WEATHER], tool_choice="auto", stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    assert not whole.choices[0].message.tool_calls and whole.choices[0].finish_reason in ("stop", "length")


def test_unsupported_and_hostile_schemas_get_a_400_quickly(tiny: Server) -> None:
    # 300 levels: 600 of JSON nesting, past what Python's own encoder (or ours, recursing) would take.
    deep = '{"type": "object", "properties": {"a": ' * 300 + '{"type": "string"}' + "}}" * 300
    cases = [
        ('{"type": "array", "contains": {"type": "integer"}}', "contains"),
        (deep, "deeper than"),
        (json.dumps({"enum": [f"v{i}" for i in range(100_000)]}), "too big"),
        (json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "$ref"),
    ]
    for schema, says in cases:
        started = time.monotonic()
        body = json.dumps({"model": "qwen3", "messages": ASK, "max_tokens": 4, "response_format": _format({})})
        body = body.replace('"schema": {}', f'"schema": {schema}')
        reply = httpx.post(f"{tiny.url}/v1/chat/completions", content=body, timeout=30)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["code"]) == ("response_format", "unsupported_schema")
        assert says in error["message"]
        assert time.monotonic() - started < 5.0
    bad_tool = {**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "object", "if": {}}}}
    body = {"model": "qwen3", "messages": ASK, "max_tokens": 4, "tools": [bad_tool], "tool_choice": "required"}
    error = httpx.post(f"{tiny.url}/v1/chat/completions", json=body, timeout=30).json()["error"]
    assert error["param"] == "tools" and '"if"' in error["message"]


def test_a_dead_end_fails_its_request_and_the_batch_goes_on(tiny: Server) -> None:
    loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
    trap = {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"], **loop}
    results: dict[str, httpx.Response] = {}

    async def post(name: str, body: dict[str, Any]) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            results[name] = await client.post(f"{tiny.url}/v1/chat/completions", json=body)

    async def both() -> None:
        base = {"model": "qwen3", "messages": ASK, "temperature": 0.0}
        async with anyio.create_task_group() as tg:
            tg.start_soon(post, "trap", {**base, "max_tokens": 40, "response_format": _format(trap)})
            tg.start_soon(post, "free", {**base, "max_tokens": 40})

    anyio.run(both)
    assert results["trap"].status_code == 500
    assert results["trap"].json()["error"]["code"] == "constraint_failed"
    assert results["free"].status_code == 200 and results["free"].json()["usage"]["completion_tokens"] > 0
    assert httpx.get(f"{tiny.url}/ready").status_code == 200


async def _chat(server: Server, max_tokens: int, schema: dict[str, Any] | None, prompt: str) -> str:
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
        extra = {"response_format": _format(schema)} if schema else {}
        reply = await client.chat.completions.create(
            model="qwen3",
            messages=[{"role": "user", "content": prompt}],
            temperature=0.0,
            max_tokens=max_tokens,
            **extra,
        )
        return reply.choices[0].message.content or ""


def test_eight_at_once_half_constrained_equal_each_alone(tiny: Server, tiny_tp2: Server) -> None:
    """Alone on one rank, then eight at once on one rank and on two: every text the same."""
    jobs = [(12 + 3 * i, SCHEMAS[i] if i % 2 else None, f"prompt number {i} " * (i + 1)) for i in range(8)]

    async def together(server: Server) -> list[str]:
        out: list[str] = [""] * len(jobs)

        async def one(i: int) -> None:
            out[i] = await _chat(server, *jobs[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(jobs)):
                tg.start_soon(one, i)
        return out

    async def run() -> tuple[list[str], list[str], list[str]]:
        return [await _chat(tiny, *job) for job in jobs], await together(tiny), await together(tiny_tp2)

    alone, batched, split = anyio.run(run)
    assert batched == alone and split == alone
    assert all(text.startswith(("{", "[", '"')) for text, job in zip(alone, jobs, strict=True) if job[1])
    assert len(set(alone)) == len(alone)


def test_the_schema_describes_the_new_fields_and_replies(tiny: Server) -> None:
    document = httpx.get(f"{tiny.url}/openapi.json").json()
    chat = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    for name in ("response_format", "tools", "tool_choice", "parallel_tool_calls"):
        assert name in chat["properties"], name
    completion = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert "response_format" in completion["schema"]["properties"]
    message = document["components"]["schemas"]["ChatCompletion"]["properties"]["choices"]["items"]["properties"]
    assert "tool_calls" in message["message"]["properties"]
    assert "tool_calls" in message["finish_reason"]["enum"]
