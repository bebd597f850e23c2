"""Tools as agent frameworks use them, through the official openai client against a real ``neuron serve``: the
loop of a forced call, its result, and a turn left to the model (``auto``), on chat and Responses, whole and
streamed; on SmolLM2 and a tiny model, whose templates show no tools, and on one whose template does. And
tools declared with pydantic, whose parameters keep nested models in ``$defs``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from testkit import TOOLS_TEMPLATE, Server, serving, with_template
from testkit.tools import PLAN_TRIP, SHIP_PARCEL, WEATHER, Parcel, Trip

SMOL = "SmolLM2-135M-Instruct"
ASK = "What is the weather like in Paris today?"
RESULT = json.dumps({"temperature": 21, "sky": "sunny"})
# A random model's text never ends by itself: four tokens, then the end of turn ("<|im_end|>", token 2).
ENDS_SOON: dict[str, Any] = {"logit_bias": {"2": 100}, "extra_body": {"min_tokens": 4}}
# Room for a call: a random model's city can be 20 characters of four bytes, and the tiny model's tokens are bytes.
CALL = {"max_tokens": 300, "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def smol(smollm2_server: Server) -> Server:
    return smollm2_server


@pytest.fixture(scope="module")
def plain(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model with its own template, which knows neither tools nor the role ``tool``."""
    with serving(tmp_path_factory, "--model", str(tiny_models["qwen3"])) as server:
        yield server


@pytest.fixture(scope="module")
def native(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model with a template that renders tools and calls, in a markup mlx-lm reads."""
    model = with_template(tiny_models["qwen3"], tmp_path_factory.mktemp("tools") / "qwen3", TOOLS_TEMPLATE)
    with serving(tmp_path_factory, "--model", str(model)) as server:
        yield server


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _model(server: Server) -> str:
    return SMOL if server.args == () else "qwen3"


def _chat(server: Server, stream: bool, **args: Any) -> tuple[str, list[dict[str, Any]], str]:
    """One chat turn, whole or streamed: the content, the calls as the next turn sends them back, and the reason."""
    args = {"model": _model(server), "temperature": 0.0, **args}
    if not stream:
        choice = _client(server).chat.completions.create(**args).choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, choice.finish_reason
    chunks = [c.choices[0] for c in _client(server).chat.completions.create(**args, stream=True) if c.choices]
    deltas = [call for c in chunks for call in c.delta.tool_calls or []]
    assert [d.index for d in deltas] == list(range(len(deltas)))
    calls = [{"id": d.id, "type": "function", "function": d.function.model_dump()} for d in deltas]  # whole, one each
    return "".join(c.delta.content or "" for c in chunks), calls, chunks[-1].finish_reason


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("which", ["smol", "plain", "native"])
def test_an_agent_loop_on_chat_is_answered_at_every_step(
    which: str, stream: bool, request: pytest.FixtureRequest
) -> None:
    server: Server = request.getfixturevalue(which)
    ask = [{"role": "user", "content": ASK}]
    content, calls, reason = _chat(server, stream, messages=ask, tools=[WEATHER], tool_choice="required", **CALL)
    assert (content, reason) == ("", "tool_calls") and calls
    _arguments(calls[0])
    # The next turn as agent loops send it: the same tools, no tool_choice, the call and its result.
    history = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": call["id"], "content": RESULT} for call in calls),
    ]
    ends = {} if which == "smol" else ENDS_SOON
    content, calls, reason = _chat(server, stream, messages=history, tools=[WEATHER], max_tokens=60, **ends)
    # No call markup in the reply: plain content, ended by the model.
    assert (calls, reason) == ([], "stop") and content.strip()
    if which == "smol":
        assert "sunny" in content  # the result reached the model, in words it reads


def _respond(server: Server, stream: bool, **args: Any) -> Any:
    """One Responses turn, whole or streamed: the final Response."""
    args = {"model": _model(server), "temperature": 0.0, **args}
    if not stream:
        return _client(server).responses.create(**args)
    events = list(_client(server).responses.create(**args, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat tool in the Responses shape."""
    return {"type": "function", **tool["function"]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("which", ["smol", "plain", "native"])
def test_an_agent_loop_on_responses_is_answered_at_every_step(
    which: str, stream: bool, request: pytest.FixtureRequest
) -> None:
    server: Server = request.getfixturevalue(which)
    tools = [_function(WEATHER)]
    forced = {"tool_choice": "required", "max_output_tokens": CALL["max_tokens"], "parallel_tool_calls": False}
    first = _respond(server, stream, input=ASK, tools=tools, **forced)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    (call,) = first.output
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    follow = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
    ]
    # Responses takes no logit_bias: a random model's text runs to max_output_tokens.
    second = _respond(server, stream, input=follow, tools=tools, max_output_tokens=60 if which == "smol" else 6)
    assert [item.type for item in second.output] == ["message"] and second.output_text.strip()
    assert second.status == "completed" if which == "smol" else second.status in ("completed", "incomplete")
    if which == "smol":
        assert "sunny" in second.output_text


PLAN = "Plan a trip to Oslo for two nights."
MODELS = {"plan_trip": Trip, "ship_parcel": Parcel}


def test_pydantic_tools_with_defs_on_chat_and_responses(plain: Server) -> None:
    """Two tools whose parameters each hold their own ``Address`` in ``$defs``: required, named and auto."""
    named = {"type": "function", "function": {"name": "ship_parcel"}}
    chat: dict[str, Any] = {"messages": [{"role": "user", "content": PLAN}], "tools": [PLAN_TRIP, SHIP_PARCEL]}
    # One call, whose JSON is a few hundred tokens at most at one token a byte: the bounds hold a random model.
    forced = {"max_tokens": 1500, "parallel_tool_calls": False}
    for choice, reason in (("required", "tool_calls"), (named, "stop")):
        content, calls, finish = _chat(plain, False, **chat, tool_choice=choice, **forced)
        assert (content, finish, len(calls)) == ("", reason, 1)
        function = calls[0]["function"]
        MODELS[function["name"]].model_validate_json(function["arguments"])  # pydantic reads back what it declared
        assert choice == "required" or function["name"] == "ship_parcel"
    content, calls, finish = _chat(plain, False, **chat, max_tokens=16, **ENDS_SOON)
    assert (calls, finish) == ([], "stop") and content

    tools = [_function(PLAN_TRIP), _function(SHIP_PARCEL)]
    responses = {"input": PLAN, "tools": tools, "max_output_tokens": 1500, "parallel_tool_calls": False}
    for choice in ("required", {"type": "function", "name": "ship_parcel"}):
        reply = _respond(plain, False, **responses, tool_choice=choice)
        (call,) = reply.output
        assert reply.status == "completed" and call.type == "function_call"
        MODELS[call.name].model_validate_json(call.arguments)
    reply = _respond(plain, False, **{**responses, "max_output_tokens": 4})
    assert [item.type for item in reply.output] == ["message"]
