"""The pure pieces of structured output, fast: tool calls read from canned model outputs with mlx-lm's own
parsers, schemas the grammar engine refuses, and rank 0's masked sampling on real logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import PLAN_TRIP, SHIP_PARCEL, TOOLS_TEMPLATE
from mlx_lm.tool_parsers import json_tools, mistral

from neuron.server.common import tools
from neuron.server.common.chat import parse
from neuron.server.common.errors import ApiError

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
    reader = tools.TextToolStream(_auto(**body), markup)
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
    reader = tools.TextToolStream(_auto(), markup)
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
    reader = tools.TextToolStream(required, None)
    assert reader.push('[{"name": "get_time", "parameters": {}}]') == ""
    _, calls, reason = reader.finish("stop")
    assert reason == "tool_calls" and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    named = tools.parse({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named is not None and named.schema() == WEATHER["function"]["parameters"]


@pytest.mark.unit
def test_a_forced_call_cut_short_by_max_tokens_stays_a_call_with_reason_length() -> None:
    """Issue 45's part 4 on a model without harmony: the named function's arguments, or the required call's name
    and parameters, as far as they came; the finish reason stays "length"."""
    named = tools.parse({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    required = tools.parse({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert named is not None and required is not None
    for chosen, text, arguments in (
        (named, '{"city": "Par', '{"city": "Par'),
        (required, '[{"name": "get_weather", "parameters": {"ci', '{"ci'),
    ):
        _, calls, reason = tools.end(tools.TextToolStream(chosen, None), text, "length")
        assert reason == "length" and calls is not None
        assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": arguments}]


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
    out = tools.template_messages(messages, _auto(), markup=None)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert "otherwise answer in text" in out[0]["content"]
    assert json.loads(out[2]["content"]) == [{"name": "get_weather", "parameters": {}}]
    # A result is a user's message, which every template renders; parallel results are one message.
    assert out[3] == {"role": "user", "content": "get_weather returned: sunny"}
    parallel = [*messages, {"role": "tool", "content": "12:00", "tool_call_id": "c2"}]
    assert tools.template_messages(parallel, None, markup=None)[2:] == [
        {"role": "user", "content": "get_weather returned: sunny\nA function returned: 12:00"}
    ]
    assert tools.template_messages(messages, _auto(), markup=HERMES) is messages


def _neurons(pieces: list[str], reason: str = "stop") -> tuple[str, str, list, str]:
    """Feed ``pieces`` to a reader of neuron's own form; return what it released before the end, the rest, the
    calls and the finish reason."""
    reader = tools.TextToolStream(_auto(), None)
    released = "".join(reader.push(p) for p in pieces)
    tail, calls, reason = reader.finish(reason)
    return released, tail, calls, reason


def test_neurons_form_reads_calls_that_open_the_reply_and_releases_text_at_once() -> None:
    text = '\n [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}] Done.'
    released, tail, calls, reason = _neurons(_split(text))
    assert (released, tail, reason) == ("", "Done.", "tool_calls")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    _, _, calls, _ = _neurons(['{"name": "get_time", "parameters": {}}'])  # one call, not in an array
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    # Text first: no call can follow, and the text is released as it comes.
    assert _neurons([" Sunny", ' [{"name": "get_time"}]']) == (' Sunny [{"name": "get_time"}]', "", [], "stop")
    assert _neurons(["  "]) == ("", "  ", [], "stop")
    # JSON that is not a call to one of the tools is an answer.
    rockets = '[{"name": "launch_rockets", "parameters": {}}]'
    for answer in ("[1, 2]", '{"city": "Paris"}', rockets, "[]", "[1,"):
        assert _neurons(_split(answer)) == ("", answer, [], "stop")
    assert _neurons(["[" * 100_000]) == ("", "[" * 100_000, [], "stop")  # deeper than Python's parser goes


def test_a_template_with_tools_gets_them_and_mlx_lm_knows_its_markup(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from conftest import with_template

    from neuron.engine.text import Text

    assert Text.load(tiny_models["qwen3"]).tool_markup is None  # its own template shows no tools
    text = Text.load(with_template(tiny_models["qwen3"], tmp_path / "qwen3", TOOLS_TEMPLATE))
    assert text.tool_markup is not None and text.tool_markup[0] == "<tool_call>"
    asked = _auto()
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": WEATHER_CALL}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    }
    messages = parse(body, served_model="m").messages  # the arguments string back to an object
    shown = tools.template_messages(messages, asked, text.tool_markup)
    prompt = text.tokenizer.decode(text.encode_chat(shown, asked.specs))
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<|im_start|>tool\nsunny" in prompt


def test_each_tools_defs_resolve_within_it_for_required_and_named(tiny_models: dict[str, Path]) -> None:
    """Two pydantic tools, each with an ``Address`` of its own in ``$defs``: each call is held to its own. And a
    ``$ref`` to ``#`` means the tool's own root, not the array of calls around it."""
    from neuron.engine.text import Text
    from neuron.grammar import Grammars

    text = Text.load(tiny_models["qwen3"])
    grammars = Grammars(text.tokenizer._tokenizer, 259, sorted(text.eos_token_ids))

    def fits(asked: tools.Tools, output: str) -> bool:
        schema = asked.schema()
        assert schema is not None
        constraint = grammars.compile(schema)
        return all(constraint.advance(token) is None for token in text.encode(output))

    trip = '{"destination": {"city": "Oslo", "country": "NO"}, "stops": [], "nights": 2}'
    parcel = '{"to": {"zip": "75001"}}'
    both = {"tools": [PLAN_TRIP, SHIP_PARCEL]}
    next_link = {"anyOf": [{"$ref": "#"}, {"type": "null"}]}
    chain = {"type": "object", "properties": {"next": next_link}, "required": ["next"]}
    linked = {"type": "function", "function": {"name": "chain", "parameters": chain}}
    required = tools.parse({"tools": [PLAN_TRIP, SHIP_PARCEL, linked], "tool_choice": "required"})
    assert required is not None
    assert fits(required, '[{"name": "chain", "parameters": {"next": {"next": null}}}]')
    assert fits(required, f'[{{"name": "plan_trip", "parameters": {trip}}}]')
    assert fits(required, f'[{{"name": "ship_parcel", "parameters": {parcel}}}]')
    assert not fits(required, '[{"name": "ship_parcel", "parameters": {"to": {"city": "Oslo"}}}]')
    assert not fits(required, f'[{{"name": "plan_trip", "parameters": {trip.replace("Oslo", "x" * 21)}}}]')
    for name, good, bad in (("plan_trip", trip, parcel), ("ship_parcel", parcel, trip)):
        named = tools.parse({**both, "tool_choice": {"type": "function", "function": {"name": name}}})
        assert named is not None and fits(named, good) and not fits(named, bad)
