"""Tool calls read in neuron's own form, a template that renders tools with the tiny model's tokenizer, and each
pydantic tool's ``$defs`` held by the grammar engine. The parsers on canned outputs: tests/unit/server/
test_tool_parsing.py."""

from __future__ import annotations

import json
from pathlib import Path

from neuron.server.common import tools
from neuron.server.common.chat import parse
from testkit import TOOLS_TEMPLATE
from testkit.tools import PLAN_TRIP, SHIP_PARCEL, in_pieces, weather_and_time

WEATHER_CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def _neurons(pieces: list[str], reason: str = "stop") -> tuple[str, str, list, str]:
    """Feed ``pieces`` to a reader of neuron's own form; return what it released before the end, the rest, the
    calls and the finish reason."""
    reader = tools.TextToolStream(weather_and_time(), None)
    released = "".join(reader.push(p) for p in pieces)
    tail, calls, reason = reader.finish(reason)
    return released, tail, calls, reason


def test_neurons_form_reads_calls_that_open_the_reply_and_releases_text_at_once() -> None:
    text = '\n [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}] Done.'
    released, tail, calls, reason = _neurons(in_pieces(text))
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
        assert _neurons(in_pieces(answer)) == ("", answer, [], "stop")
    assert _neurons(["[" * 100_000]) == ("", "[" * 100_000, [], "stop")  # deeper than Python's parser goes


def test_a_template_with_tools_gets_them_and_mlx_lm_knows_its_markup(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from neuron.engine.text import Text
    from testkit import with_template

    assert Text.load(tiny_models["qwen3"]).tool_markup is None  # its own template shows no tools
    text = Text.load(with_template(tiny_models["qwen3"], tmp_path / "qwen3", TOOLS_TEMPLATE))
    assert text.tool_markup is not None and text.tool_markup[0] == "<tool_call>"
    asked = weather_and_time()
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
