"""Anthropic's Messages API through the official `anthropic` client, against the tiny thinking model (conftest's
thinking_server): whole, streamed (the event order checked exactly), tools round trip, thinking, stop sequences,
count_tokens, errors in Anthropic's shape, and a request shaped like Claude Code's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from starlette.testclient import TestClient

from neuron.server.app import ServerState, build_app
from neuron.server.keys import load
from testkit import Server, serving
from testkit.models import make_thinking_model

MODEL = "tiny-thinker"
HI = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    # A city from a list: the random model never closes a string of its own accord.
    "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]},
}
OFF = {"type": "disabled"}
GREEDY = {"temperature": 0}  # sent as extra_body: this client no longer has sampling arguments, the route still does


@pytest.fixture(scope="module")
def client(thinking_server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0)


def raw_events(server: Server, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed reply's (event name, data) pairs, read off the wire."""
    with httpx.stream("POST", f"{server.url}/v1/messages", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        if block.startswith(":"):  # a keep-alive comment: sent after 2 s without an event (a slow prefill, under load)
            continue
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(name == data["type"] for name, data in events)
    return events


def test_whole_message(client: anthropic.Anthropic) -> None:
    reply = client.messages.create(model=MODEL, max_tokens=6, messages=HI, extra_body=GREEDY, thinking=OFF)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert reply.id.startswith("msg_") and reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    assert [block.type for block in reply.content] == ["text"] and reply.content[0].text
    assert reply.usage.output_tokens == 6 and reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 10


def test_thinking_comes_back_as_a_thinking_block(client: anthropic.Anthropic) -> None:
    reply = client.messages.create(model=MODEL, max_tokens=6, messages=HI, extra_body=GREEDY)  # the template thinks
    assert [block.type for block in reply.content] == ["thinking"] and reply.content[0].thinking
    enabled = {"type": "enabled", "budget_tokens": 1024}
    again = client.messages.create(model=MODEL, max_tokens=6, messages=HI, extra_body=GREEDY, thinking=enabled)
    assert again.content == reply.content
    off = client.messages.create(model=MODEL, max_tokens=1, messages=HI, extra_body=GREEDY, thinking=OFF)
    assert [block.type for block in off.content] == ["text"]


def test_streamed_events_come_in_anthropics_order(client: anthropic.Anthropic, thinking_server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 6, "messages": HI, "temperature": 0}
    events = raw_events(thinking_server, body)
    names = " ".join(
        f"{name}:{data['delta']['type']}" if name == "content_block_delta" else name for name, data in events
    )
    pattern = (
        r"message_start content_block_start( content_block_delta:thinking_delta)+ "
        r"content_block_delta:signature_delta content_block_stop message_delta message_stop"
    )
    assert re.fullmatch(pattern, names), names
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "thinking", "thinking": "", "signature": ""},
    }
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 6
    # The client's own accumulation of the stream gives the whole reply.
    asked = {**{k: v for k, v in body.items() if k != "temperature"}, "extra_body": GREEDY}
    with client.messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    whole = client.messages.create(**asked)
    assert [b.thinking for b in streamed.content] == [b.thinking for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason


def test_text_then_tool_use_blocks_stream_in_order(thinking_server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 60, "messages": HI, "temperature": 0, "thinking": OFF}
    body |= {"tools": [WEATHER], "tool_choice": {"type": "any"}}
    events = raw_events(thinking_server, body)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [data for name, data in events if name == "content_block_start"]
    assert starts[-1]["content_block"]["type"] == "tool_use" and starts[-1]["content_block"]["input"] == {}
    partial = [d["delta"]["partial_json"] for n, d in events if d.get("delta", {}).get("type") == "input_json_delta"]
    assert json.loads("".join(partial))["city"] in ("Paris", "Rome")
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tools_round_trip(client: anthropic.Anthropic) -> None:
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 60, "thinking": OFF, "tools": [WEATHER]}
    common["extra_body"] = GREEDY
    reply = client.messages.create(messages=HI, tool_choice={"type": "any"}, **common)
    assert reply.stop_reason == "tool_use"
    (call,) = [block for block in reply.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Rome") and call.id.startswith("toolu_")
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny, 21 C"}]}
    turns = [*HI, {"role": "assistant", "content": reply.content}, {"role": "user", "content": [result]}]
    answer = client.messages.create(messages=turns, tool_choice={"type": "none"}, **{**common, "max_tokens": 4})
    assert answer.stop_reason == "max_tokens" and answer.content[0].type == "text"
    # The tool result reached the prompt: the second turn's prompt holds the call and the result. Whole prompts are
    # compared (what the cache held from earlier tests only moves tokens between the two usage fields), and without
    # tools on either side (tool_choice none shows the model none).
    without_result = client.messages.count_tokens(model=MODEL, messages=turns[:2])
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > without_result.input_tokens + 10
    named = client.messages.create(messages=HI, tool_choice={"type": "tool", "name": "get_weather"}, **common)
    assert [block.name for block in named.content if block.type == "tool_use"] == ["get_weather"]


@pytest.mark.parametrize(
    ("tool_choice", "max_tokens"),
    [({"type": "tool", "name": "get_weather"}, 5), ({"type": "any"}, 42)],  # any: past the call's name
)
def test_a_forced_call_cut_short_is_still_a_tool_use(
    client: anthropic.Anthropic, tool_choice: Any, max_tokens: int
) -> None:
    """max_tokens ends the call inside its arguments: a tool_use block (its input as far as an object holds it),
    stop_reason max_tokens; never a text block of raw JSON."""
    reply = client.messages.create(
        model=MODEL, max_tokens=max_tokens, messages=HI, tools=[WEATHER], tool_choice=tool_choice, thinking=OFF,
        extra_body=GREEDY,
    )  # fmt: skip
    assert reply.stop_reason == "max_tokens"
    assert [(b.type, getattr(b, "name", None)) for b in reply.content] == [("tool_use", "get_weather")]


def test_a_stop_sequence_is_named(client: anthropic.Anthropic) -> None:
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "messages": HI, "extra_body": GREEDY, "thinking": OFF}
    text = client.messages.create(**common).content[0].text
    stop = text[2:4]
    cut = client.messages.create(stop_sequences=[stop], **common)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]
    with client.messages.stream(stop_sequences=[stop], **common) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.content[0].text == cut.content[0].text


def test_count_tokens_is_the_prompt_the_reply_reports(client: anthropic.Anthropic) -> None:
    system = "You are terse."
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=HI, tools=[WEATHER])
    reply = client.messages.create(
        model=MODEL, max_tokens=1, system=system, messages=HI, tools=[WEATHER], tool_choice={"type": "none"}
    )
    # tool_choice none shows the model no tools, as the chat route does; with them the prompt is longer.
    plain = client.messages.count_tokens(model=MODEL, system=system, messages=HI)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == plain.input_tokens
    assert counted.input_tokens > plain.input_tokens


def test_errors_have_anthropics_shape_and_name_the_field(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4, messages=HI, extra_body={"frequency": 1})
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "unrecognized request argument `frequency`"},
    }
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4, messages=HI, stop_sequences=["a", "b", "c", "d", "e"])
    assert "`stop_sequences`" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="another-model", max_tokens=4, messages=HI)
    assert missing.value.body["error"]["type"] == "not_found_error"


def test_a_claude_code_style_request_is_answered(thinking_server: Server) -> None:
    tools = [
        {
            "name": name,
            "description": f"{name} a file",
            "input_schema": {
                "type": "object",
                "properties": {"file_path": {"type": "string"}},
                "required": ["file_path"],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
        }
        for name in ("Read", "Write", "Edit")
    ]
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    body = {
        "model": MODEL,
        "max_tokens": 32,
        "temperature": 1,
        "system": [
            {"type": "text", "text": "You are Claude Code, an interactive CLI tool."},
            {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "read README.md", "cache_control": None}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Reading it."}]},
            {"role": "system", "content": "The user switched to plan mode."},  # newer Claude Code puts these here
            {"role": "user", "content": "go on"},
        ],
        "tools": tools,
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "user_abc_account_0_session_1"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
    }
    events = raw_events(thinking_server, body)
    assert events[0][0] == "message_start" and [name for name, _ in events[-2:]] == ["message_delta", "message_stop"]
    assert not [data for name, data in events if name == "error"]


def test_x_api_key_is_a_key_too() -> None:
    """The leader's HTTP layer alone, not loaded: a right key gets past the check to the not-ready answer."""
    with TestClient(build_app(ServerState(model_id=MODEL, keys=load("k", None))), base_url="http://127.0.0.1") as http:
        body = {"model": MODEL, "max_tokens": 4, "messages": HI}
        for headers, status, kind in [
            ({}, 401, "authentication_error"),
            ({"x-api-key": "wrong"}, 401, "authentication_error"),
            ({"x-api-key": "k"}, 503, "overloaded_error"),
            ({"authorization": "Bearer k"}, 503, "overloaded_error"),
        ]:
            response = http.post("/v1/messages", json=body, headers=headers)
            assert response.status_code == status and response.json()["error"]["type"] == kind, headers
        chat = {"model": MODEL, "messages": HI}
        assert http.post("/v1/chat/completions", json=chat, headers={"x-api-key": "k"}).status_code == 503


@pytest.fixture(scope="module")
def thinking_tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_thinking_model(tmp_path_factory.mktemp("thinking-tp2") / MODEL)
    with serving(tmp_path_factory, "--model", str(model), "--tp", "2") as server:
        yield server


def test_two_ranks_think_and_call_tools_the_same_way(thinking_tp2: Server) -> None:
    """Over two ranks the split, the grammar after the thinking and the events are the same code: one pass."""
    client = anthropic.Anthropic(base_url=thinking_tp2.url, api_key="unused", max_retries=0)
    events = raw_events(thinking_tp2, {"model": MODEL, "max_tokens": 4, "messages": HI, "temperature": 0})
    assert [name for name, _ in events][:2] == ["message_start", "content_block_start"]
    assert events[1][1]["content_block"]["type"] == "thinking" and events[-1][0] == "message_stop"
    reply = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=HI,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        thinking=OFF,
        extra_body=GREEDY,
    )
    assert reply.stop_reason == "tool_use" and reply.content[-1].input["city"] in ("Paris", "Rome")


def test_output_config_format_holds_the_text_to_a_schema(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"prime": {"enum": ["yes", "no"]}}, "required": ["prime"]}
    reply = client.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": "Is 7 prime?"}],
        thinking=OFF,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert reply.stop_reason == "end_turn" and json.loads(reply.content[-1].text)["prime"] in ("yes", "no")
