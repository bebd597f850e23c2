"""The pure pieces of structured output, fast: tool calls read from canned model outputs with mlx-lm's own
parsers, schemas the grammar engine refuses, and rank 0's masked sampling on real logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TOOLS_TEMPLATE
from mlx_lm.tool_parsers import json_tools, mistral

from neuron.server import tools
from neuron.server.openai import ApiError, parse

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES = (json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call)
MISTRAL = (mistral.tool_call_start, mistral.tool_call_end, mistral.parse_tool_call)


def _auto(**body: object) -> tools.Tools:
    parsed = tools.parse({"tools": [WEATHER, TIME], **body})
    assert parsed is not None
    return parsed


def _read(markup: tools.ToolMarkup, pieces: list[str], reason: str = "stop", **body: object) -> tuple[str, list, str]:
    """Feed ``pieces`` as a stream would; return all the content released, the calls and the finish reason."""
    reader = tools.ToolStream(_auto(**body), markup)
    released = "".join(reader.push(p) for p in pieces)
    tail, calls, reason = reader.finish(reason)
    return released + tail, calls, reason


def _split(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.unit
def test_hermes_calls_leave_the_content_and_become_tool_calls() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls, reason = _read(HERMES, _split(text))  # markers split across pieces, as tokens split them
    assert content == "Let me check.\n" and reason == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert "<tool_call>" not in content and "tool_call" not in content


@pytest.mark.unit
def test_mistral_calls_parse_too() -> None:
    content, calls, reason = _read(MISTRAL, _split('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', 4))
    assert (content, reason) == ("", "tool_calls")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("markup", "text"),
    [
        (HERMES, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'),  # bad JSON
        (HERMES, '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'),  # not among the tools
        (MISTRAL, "[TOOL_CALLS]get_weather[ARGS]{oops"),
    ],
)
def test_a_malformed_call_is_a_plain_text_answer(markup: tools.ToolMarkup, text: str) -> None:
    reader = tools.ToolStream(_auto(), markup)
    released = "".join(reader.push(p) for p in _split(text))
    tail, calls, reason = reader.finish("stop")
    assert (released + tail, calls, reason) == (text, [], "stop")
    assert reader.error


@pytest.mark.unit
def test_text_that_only_looks_like_a_marker_is_released() -> None:
    assert _read(HERMES, ["a <tool", "_ca", "t> b"]) == ("a <tool_cat> b", [], "stop")
    # Cut by max_tokens inside a call: nothing to parse, the text is what there is.
    text = '<tool_call>{"name": "get_weather", "argu'
    assert _read(HERMES, _split(text), reason="length") == (text, [], "length")


@pytest.mark.unit
def test_forced_calls_read_the_constrained_json() -> None:
    required = tools.parse({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    assert required is not None and required.schema()["maxItems"] == 1  # type: ignore[index]
    reader = tools.ToolStream(required, None)
    assert reader.push('[{"name": "get_time", "parameters": {}}]') == ""
    _, calls, reason = reader.finish("stop")
    assert reason == "tool_calls" and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    named = tools.parse({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named is not None and named.schema() == WEATHER["function"]["parameters"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_tool_fields_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        tools.parse(body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.unit
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
    out = tools.template_messages(messages, _auto(), renders_tools=False)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert json.loads(out[2]["content"]) == [{"name": "get_weather", "parameters": {}}]
    assert out[3] == {"role": "tool", "content": "sunny"}
    assert tools.template_messages(messages, _auto(), renders_tools=True) is messages


def test_a_template_with_tools_gets_them_and_mlx_lm_knows_its_markup(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from conftest import with_template

    from neuron.engine.text import Text

    text = Text.load(with_template(tiny_models["qwen3"], tmp_path / "qwen3", TOOLS_TEMPLATE))
    assert text.renders_tools and text.tool_markup is not None and text.tool_markup[0] == "<tool_call>"
    asked = _auto()
    tools.check_model(asked, text.renders_tools, text.tool_markup)
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": WEATHER_CALL}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    }
    messages = parse(body, chat=True, served_model="m").messages  # the arguments string back to an object
    prompt = text.tokenizer.decode(text.encode_chat(tools.template_messages(messages, asked, True), asked.specs))
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<|im_start|>tool\nsunny" in prompt
    with pytest.raises(ApiError) as e:
        tools.check_model(asked, renders_tools=False, markup=None)
    assert e.value.param == "tool_choice" and "required" in e.value.message
