"""The pure pieces of structured output, fast: tool calls read from canned model outputs with mlx-lm's own
parsers, forced calls, bad tool fields, and earlier calls shown to a template without tools. neuron's own form and
the tiny model's templates and grammars: tests/e2e/structured/test_tool_parsing.py."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import json_tools, mistral

from neuron.server.common import tools
from neuron.server.common.errors import ApiError
from testkit.tools import GET_TIME, GET_WEATHER, in_pieces, weather_and_time

HERMES = (json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call)
MISTRAL = (mistral.tool_call_start, mistral.tool_call_end, mistral.parse_tool_call)


def _read(markup: tools.ToolMarkup, pieces: list[str], reason: str = "stop", **body: object) -> tuple[str, list, str]:
    """Feed ``pieces`` as a stream would; return all the content released, the calls and the finish reason."""
    reader = tools.TextToolStream(weather_and_time(**body), markup)
    released = "".join(reader.push(p) for p in pieces)
    tail, calls, reason = reader.finish(reason)
    return released + tail, calls, reason


def test_hermes_calls_leave_the_content_and_become_tool_calls() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls, reason = _read(HERMES, in_pieces(text))  # markers split across pieces, as tokens split them
    assert content == "Let me check.\n" and reason == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert "<tool_call>" not in content and "tool_call" not in content


def test_mistral_calls_parse_too() -> None:
    content, calls, reason = _read(MISTRAL, in_pieces('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', 4))
    assert (content, reason) == ("", "tool_calls")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]


@pytest.mark.parametrize(
    ("markup", "text"),
    [
        (HERMES, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'),  # bad JSON
        (HERMES, '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'),  # not among the tools
        (MISTRAL, "[TOOL_CALLS]get_weather[ARGS]{oops"),
    ],
)
def test_a_malformed_call_is_a_plain_text_answer(markup: tools.ToolMarkup, text: str) -> None:
    reader = tools.TextToolStream(weather_and_time(), markup)
    released = "".join(reader.push(p) for p in in_pieces(text))
    tail, calls, reason = reader.finish("stop")
    assert (released + tail, calls, reason) == (text, [], "stop")
    assert reader.error


def test_text_that_only_looks_like_a_marker_is_released() -> None:
    assert _read(HERMES, ["a <tool", "_ca", "t> b"]) == ("a <tool_cat> b", [], "stop")
    # Cut by max_tokens inside a call: nothing to parse, the text is what there is.
    text = '<tool_call>{"name": "get_weather", "argu'
    assert _read(HERMES, in_pieces(text), reason="length") == (text, [], "length")


def test_forced_calls_read_the_constrained_json() -> None:
    required = tools.parse({"tools": [GET_WEATHER, GET_TIME], "tool_choice": "required", "parallel_tool_calls": False})
    assert required is not None and required.schema()["maxItems"] == 1  # type: ignore[index]
    reader = tools.TextToolStream(required, None)
    assert reader.push('[{"name": "get_time", "parameters": {}}]') == ""
    _, calls, reason = reader.finish("stop")
    assert reason == "tool_calls" and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    named = tools.parse(
        {"tools": [GET_WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert named is not None and named.schema() == GET_WEATHER["function"]["parameters"]


def test_a_forced_call_cut_short_by_max_tokens_stays_a_call_with_reason_length() -> None:
    """Issue 45's part 4 on a model without harmony: the named function's arguments, or the required call's name
    and parameters, as far as they came; the finish reason stays "length"."""
    named = tools.parse(
        {"tools": [GET_WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    required = tools.parse({"tools": [GET_WEATHER, GET_TIME], "tool_choice": "required"})
    assert named is not None and required is not None
    for chosen, text, arguments in (
        (named, '{"city": "Par', '{"city": "Par'),
        (required, '[{"name": "get_weather", "parameters": {"ci', '{"ci'),
    ):
        _, calls, reason = tools.end(tools.TextToolStream(chosen, None), text, "length")
        assert reason == "length" and calls is not None
        assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": arguments}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"tools": [GET_WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [GET_WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_tool_fields_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        tools.parse(body)
    assert e.value.status == 400 and e.value.param == param


def test_earlier_calls_reach_a_template_without_tools_as_text() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    out = tools.template_messages(messages, weather_and_time(), markup=None)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert "otherwise answer in text" in out[0]["content"]
    assert json.loads(out[2]["content"]) == [{"name": "get_weather", "parameters": {}}]
    # A result is a user's message, which every template renders; parallel results are one message.
    assert out[3] == {"role": "user", "content": "get_weather returned: sunny"}
    parallel = [*messages, {"role": "tool", "content": "12:00", "tool_call_id": "c2"}]
    assert tools.template_messages(parallel, None, markup=None)[2:] == [
        {"role": "user", "content": "get_weather returned: sunny\nA function returned: 12:00"}
    ]
    assert tools.template_messages(messages, weather_and_time(), markup=HERMES) is messages
