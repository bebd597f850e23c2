"""gpt-oss end to end, through the official openai and anthropic SDKs, on a tiny gpt_oss whose weights write a
chosen harmony reply (testkit.harmony): the prompt rendered by openai-harmony, the reply parsed by it into
reasoning, answer and tool calls, on one rank, two tensor-parallel ranks and two pipeline stages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI

from testkit import Server, serving
from testkit.harmony import Script, make_harmony_model

MODEL = "tiny-gpt-oss"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather now", "parameters": CITY}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALLED = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "20C"},
]
# The first turn thinks and calls the tool; once a tool's result is in the context (its author's " to=assistant"),
# it thinks and answers. The arguments are two tokens, so that max_tokens can cut the call in the middle.
CALLS = Script(
    (
        "<|channel|>", "analysis", "<|message|>", "Need the weather.", "<|end|>",
        "<|start|>", "assis", "tant to=functions.get_weather", "<|channel|>", "commentary", "<|message|>",
        '{"city": ', '"Paris"}', "<|call|>",
    )
)  # fmt: skip
ANSWERS = Script(
    (
        "<|channel|>", "analysis", "<|message|>", "Got it.", "<|end|>",
        "<|start|>", "assis", "tant", "<|channel|>", "final", "<|message|>", "It is 20 degrees.", "<|return|>",
    ),
    triggered=True,
)  # fmt: skip
CUT = 12  # max_tokens that ends the first turn inside the call's arguments


@pytest.fixture(
    scope="module",
    params=[("--tp", "1"), ("--tp", "2"), ("--pp", "2", "--micro-batches", "2")],
    ids=["tp1", "tp2", "pp2"],
)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_harmony_model(tmp_path_factory.mktemp("gpt-oss") / MODEL, [CALLS, ANSWERS], trigger=" to=assistant")
    with serving(tmp_path_factory, "--model", str(model), *request.param) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(client: OpenAI, messages: list[Any], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=[TOOL], temperature=0, **{"max_tokens": 40, **kwargs}
    )


def test_chat_reasons_calls_the_tool_and_answers_its_result(client: OpenAI) -> None:
    first = chat(client, ASK).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.reasoning_content == "Need the weather."
    assert not first.message.content
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    history = [
        *ASK,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "20C"},
    ]
    second = chat(client, history).choices[0]
    assert second.finish_reason == "stop" and second.message.content == "It is 20 degrees."
    assert second.message.reasoning_content == "Got it." and not second.message.tool_calls


@pytest.mark.parametrize(("messages", "kind"), [(ASK, "call"), (CALLED, "answer")])
def test_chat_streamed_matches_whole_and_shows_no_marker(client: OpenAI, messages: list[Any], kind: str) -> None:
    """A call's arguments stream as the model writes them (the script's are two tokens), as OpenAI's do."""
    whole = chat(client, messages).choices[0]
    thought, answer, pieces, reasons = "", "", [], []
    for chunk in chat(client, messages, stream=True):
        assert "<|" not in chunk.model_dump_json()
        for choice in chunk.choices:
            thought += getattr(choice.delta, "reasoning_content", None) or ""
            answer += choice.delta.content or ""
            pieces += choice.delta.tool_calls or []
            reasons += [choice.finish_reason] if choice.finish_reason else []
    assert (thought, answer or None) == (whole.message.reasoning_content, whole.message.content or None)
    calls = {p.index: (p.function.name, "") for p in pieces if p.id}
    for p in pieces:
        calls[p.index] = (calls[p.index][0], calls[p.index][1] + (p.function.arguments or ""))
    assert list(calls.values()) == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    written = [p.function.arguments for p in pieces if p.function.arguments]
    assert written == (['{"city": ', '"Paris"}'] if kind == "call" else [])
    assert reasons == [whole.finish_reason] == (["tool_calls"] if kind == "call" else ["stop"])


def test_n_logprobs_and_stop_strings(client: OpenAI) -> None:
    reply = chat(client, CALLED, n=2, logprobs=True, top_logprobs=2, stop=["degrees"])
    assert [c.message.content for c in reply.choices] == ["It is 20 ", "It is 20 "]
    assert all(c.finish_reason == "stop" and c.message.reasoning_content == "Got it." for c in reply.choices)
    assert all(c.logprobs and len(c.logprobs.content) >= 10 for c in reply.choices)


def test_a_call_cut_short_stays_a_call(client: OpenAI, server: Server) -> None:
    choice = chat(client, ASK, max_tokens=CUT).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": ')
    ]
    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0).messages
    reply = messages.create(model=MODEL, max_tokens=CUT, messages=ASK, tools=[ANTHROPIC_TOOL], extra_body=GREEDY)
    assert reply.stop_reason == "max_tokens" and [b.type for b in reply.content] == ["thinking", "tool_use"]


def test_responses_reason_call_and_answer(client: OpenAI, server: Server) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, temperature=0)
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == "Need the weather."  # type: ignore[union-attr,index]
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    events: Any = list(
        client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, temperature=0, stream=True)
    )
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert [e.delta for e in deltas] == ['{"city": ', '"Paris"}']  # as the model wrote them, as OpenAI streams them
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert {(e.output_index, e.item_id) for e in deltas} == {(1, final.output[1].id)}
    assert final.output[1].arguments == call.arguments  # type: ignore[union-attr]
    history: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},  # type: ignore[union-attr]
        {"type": "function_call_output", "call_id": call.call_id, "output": "20C"},  # type: ignore[union-attr]
    ]
    second = client.responses.create(model=MODEL, input=history, tools=tools, temperature=0)
    assert second.output_text == "It is 20 degrees." and second.output[0].type == "reasoning"
    with httpx.stream(
        "POST",
        f"{server.url}/v1/responses",
        json={"model": MODEL, "input": history, "tools": tools, "temperature": 0, "stream": True},
        timeout=60,
    ) as response:
        text = response.read().decode()
    assert "<|" not in text and '"type": "reasoning"' in text
    done = [
        json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and "response.completed" in line
    ]
    assert done and done[-1]["response"]["output"][-1]["content"][0]["text"] == "It is 20 degrees."


ANTHROPIC_TOOL: Any = {"name": "get_weather", "description": "The weather now", "input_schema": CITY}
GREEDY = {"temperature": 0}


def test_messages_think_call_and_answer(server: Server) -> None:
    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0).messages
    first = messages.create(model=MODEL, max_tokens=40, messages=ASK, tools=[ANTHROPIC_TOOL], extra_body=GREEDY)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["thinking", "tool_use"]
    thinking, use = first.content
    assert thinking.thinking == "Need the weather."  # type: ignore[union-attr]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}  # type: ignore[union-attr]
    with messages.stream(model=MODEL, max_tokens=40, messages=ASK, tools=[ANTHROPIC_TOOL], extra_body=GREEDY) as s:
        deltas = [
            e.delta.partial_json for e in s if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]  # type: ignore[union-attr]
        streamed = s.get_final_message()
    assert deltas == ['{"city": ', '"Paris"}']  # the arguments as the model wrote them, as Anthropic streams them
    assert [b.type for b in streamed.content] == ["thinking", "tool_use"] and streamed.stop_reason == "tool_use"
    assert streamed.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]
    history: Any = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "20C"}]},  # type: ignore[union-attr]
    ]
    with messages.stream(
        model=MODEL, max_tokens=40, messages=history, tools=[ANTHROPIC_TOOL], extra_body=GREEDY
    ) as stream:
        for event in stream:
            assert "<|" not in event.model_dump_json()
        second = stream.get_final_message()
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["thinking", "text"]
    assert second.content[1].text == "It is 20 degrees."  # type: ignore[union-attr]


DEGREES = {"type": "object", "properties": {"degrees": {"enum": [20, 21]}}, "required": ["degrees"]}
PLACES = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
PLACE_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PLACES}}


def test_a_schema_constrains_only_the_final_message(client: OpenAI) -> None:
    """The script calls the tool; the schema makes it answer, after the analysis it chose to write."""
    format_: Any = {"type": "json_schema", "json_schema": {"name": "weather", "schema": DEGREES}}
    choice = chat(client, ASK, response_format=format_, max_tokens=60).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.reasoning_content == "Need the weather."
    assert json.loads(choice.message.content)["degrees"] in (20, 21)


@pytest.mark.parametrize(
    ("tool_choice", "reason"),
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")],
)
def test_a_forced_call_keeps_its_header_and_follows_the_schema(client: OpenAI, tool_choice: Any, reason: str) -> None:
    """The script answers once the tool's result is in; the forced call makes it call again."""
    reply = client.chat.completions.create(
        model=MODEL, messages=CALLED, tools=[PLACE_TOOL], tool_choice=tool_choice, temperature=0, max_tokens=60
    )
    choice = reply.choices[0]
    assert choice.finish_reason == reason and not choice.message.content
    assert choice.message.reasoning_content == "Got it."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_tokenize_and_count_tokens_render_as_the_chat_does(client: OpenAI, server: Server) -> None:
    prompt_tokens = chat(client, ASK, max_tokens=1).usage.prompt_tokens
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": ASK, "tools": [TOOL]}).json()
    assert tokenized["count"] == prompt_tokens
    counted = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0).messages.count_tokens(
        model=MODEL, messages=ASK, tools=[ANTHROPIC_TOOL]
    )
    assert counted.input_tokens == prompt_tokens


def test_each_family_s_reasoning_control_sets_harmony_s_effort(client: OpenAI, server: Server) -> None:
    """The system message says `Reasoning: medium` by default; each byte of the level is a token of the tiny
    tokenizer, so the prompt's length tells the level apart."""
    medium = chat(client, ASK, max_tokens=1).usage.prompt_tokens
    assert chat(client, ASK, max_tokens=1, reasoning_effort="high").usage.prompt_tokens == medium - 2
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": CITY, "description": "The weather now"}]
    low = client.responses.create(
        model=MODEL, input=ASK, tools=tools, reasoning={"effort": "low"}, max_output_tokens=16, temperature=0
    )
    assert low.usage is not None and low.usage.input_tokens == medium - 3
    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0).messages
    off = messages.create(
        model=MODEL,
        max_tokens=1,
        messages=ASK,
        tools=[ANTHROPIC_TOOL],
        thinking={"type": "disabled"},
        extra_body=GREEDY,
    )
    assert off.usage.input_tokens + off.usage.cache_read_input_tokens == medium - 3


def test_responses_text_format_constrains_only_the_final_message(client: OpenAI) -> None:
    """As the chat's response_format: the script calls the tool; text.format makes it answer, analysis kept."""
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    text: Any = {"format": {"type": "json_schema", "name": "weather", "schema": DEGREES}}
    reply = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=tools, text=text, temperature=0, max_output_tokens=60
    )
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text == "Need the weather."  # type: ignore[union-attr,index]
    assert json.loads(reply.output_text)["degrees"] in (20, 21)


def test_messages_output_format_constrains_only_the_final_message(server: Server) -> None:
    """Anthropic's output_config.format, through the same path: thinking kept, the text block follows the schema."""
    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0).messages
    body = {**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": DEGREES}}}
    reply = messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=[ANTHROPIC_TOOL], extra_body=body)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert json.loads(reply.content[1].text)["degrees"] in (20, 21)  # type: ignore[union-attr]
