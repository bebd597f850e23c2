"""A thinking model's reasoning apart from its answer: the split (unit), the template controls (unit), and the chat
route through the official openai client against a tiny model whose template thinks (conftest's thinking_server).

The tiny model's weights are random: what it writes is noise, but greedy noise is the same every run, and where
the reasoning ends is steered with `logit_bias` on the `</think>` token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from neuron.sampling_params import SamplingParams
from neuron.server.common import reasoning
from neuron.server.common.errors import ApiError
from neuron.server.common.reasoning import Options, ReasoningSplit, Thinking, ThinkingSplit
from testkit import Server
from testkit.models import make_thinking_model

THINK = Thinking("<think>", "</think>", (259,), (260,))
START, END = "259", "260"  # the markers' token ids in the thinking model (conftest.make_thinking_model)


def split_all(split: ReasoningSplit, pieces: list[str]) -> tuple[str, str]:
    return split.whole(pieces[:-1], pieces[-1])


def test_split_keeps_markers_out_and_finds_them_across_tokens() -> None:
    split = ThinkingSplit(THINK, inside=False)
    assert split_all(split, ["<th", "ink>wei", "gh</", "thi", "nk>\n\nThe answer", ""]) == ("weigh", "\n\nThe answer")
    assert split.tokens == 4  # the tokens from the one opening the section to the one closing it


def test_split_starts_inside_when_the_template_opened_the_section() -> None:
    assert split_all(ThinkingSplit(THINK, inside=True), ["hmm", "</think>", "yes", ""]) == ("hmm", "yes")


def test_split_releases_a_held_marker_beginning_that_never_completes() -> None:
    split = ThinkingSplit(THINK, inside=True)
    assert split.push("a </thi") == ("a ", "")
    assert split.end("") == ("</thi", "")
    split = ThinkingSplit(THINK, inside=False)
    assert split.push("x <") == ("", "x ")
    assert split.end("b") == ("", "<b")


def test_tokenizers_decide_who_thinks_and_where_the_prompt_ends(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    from mlx_lm.utils import load_tokenizer

    plain = load_tokenizer(tiny_models["qwen3"])
    assert reasoning.splitter(plain, plain.apply_chat_template([{"role": "user", "content": "hi"}])) is None
    assert reasoning.chat_params(plain, SamplingParams()) == SamplingParams()  # a plain model's reply unchanged
    thinker = load_tokenizer(make_thinking_model(tmp_path / "thinker"))
    assert Thinking.of(thinker) == THINK
    chat = [{"role": "user", "content": "hi"}]
    assert reasoning.inside(thinker, thinker.apply_chat_template(chat, add_generation_prompt=True))
    closed = thinker.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=False)
    assert not reasoning.inside(thinker, closed) and reasoning.closed(thinker, closed)
    # A section an earlier turn closed is no closing of this one: the grammar still lets the model think.
    earlier = [*chat, {"role": "assistant", "content": "<think>a</think>b"}, {"role": "user", "content": "and 9?"}]
    again = thinker.apply_chat_template(earlier, add_generation_prompt=True)
    assert reasoning.inside(thinker, again) and not reasoning.closed(thinker, again)
    assert reasoning.grammar(thinker, closed) is None and reasoning.grammar(thinker, again) is not None


def test_reasoning_effort_goes_where_the_template_reads_it_and_is_refused_where_nothing_thinks() -> None:
    effort = Options(effort="low")
    assert reasoning.template_kwargs(effort, "{{ reasoning_effort }}", None) == {"reasoning_effort": "low"}
    assert reasoning.template_kwargs(Options(effort="none"), "plain", THINK) == {"enable_thinking": False}
    assert reasoning.template_kwargs(effort, "plain", THINK) == {}
    with pytest.raises(ApiError) as refused:
        reasoning.template_kwargs(effort, "plain", None)
    assert refused.value.param == "reasoning_effort"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"include_reasoning": "no"}, "include_reasoning"),
        ({"reasoning_effort": "maximal"}, "reasoning_effort"),
    ],
)
def test_bad_controls_are_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        reasoning.parse(body)
    assert refused.value.param == param and refused.value.status == 400


# The chat route, end to end.


@pytest.fixture(scope="module")
def client(thinking_server: Server) -> OpenAI:
    return OpenAI(base_url=f"{thinking_server.url}/v1", api_key="unused", max_retries=0)


def chat(client: OpenAI, stream: bool = False, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="tiny-thinker",
        messages=[{"role": "user", "content": "Is 7 prime?"}],
        max_tokens=12,
        temperature=0,
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        extra_body=extra,
    )


def test_reasoning_content_holds_the_thinking_and_usage_counts_it(client: OpenAI) -> None:
    # The template opened the section and the model never closes it: everything is reasoning.
    reply = chat(client)
    message = reply.choices[0].message
    assert message.reasoning_content and message.content == ""
    assert reply.usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens == 12
    # Closing it early: the reasoning up to the first end marker, which neither holds, then the answer (where this
    # biased model writes more end markers, plain text outside a section).
    reply = chat(client, logit_bias={END: 8})
    message = reply.choices[0].message
    assert message.reasoning_content and "</think>" not in message.reasoning_content
    assert message.content
    assert 0 < reply.usage.completion_tokens_details.reasoning_tokens < reply.usage.completion_tokens


def test_streamed_deltas_add_up_to_the_whole_reply(client: OpenAI) -> None:
    whole = chat(client, logit_bias={END: 8}).choices[0].message
    thought, answer, usage = "", "", None
    for chunk in chat(client, stream=True, logit_bias={END: 8}):
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            thought += getattr(choice.delta, "reasoning_content", None) or ""
            answer += choice.delta.content or ""
    assert (thought, answer) == (whole.reasoning_content, whole.content)
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens > 0


def test_enable_thinking_false_answers_without_reasoning(client: OpenAI) -> None:
    reply = chat(client, chat_template_kwargs={"enable_thinking": False}, logit_bias={START: -100})
    message = reply.choices[0].message
    assert message.content and getattr(message, "reasoning_content", None) is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    assert reply.usage.prompt_tokens == chat(client, max_tokens=1).usage.prompt_tokens + 4  # "\n\n</think>\n\n"


def test_include_reasoning_false_drops_it(client: OpenAI) -> None:
    reply = chat(client, include_reasoning=False)
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None
    assert reply.choices[0].message.content == ""
    streamed = [c for c in chat(client, stream=True, include_reasoning=False) for c in c.choices]
    assert not any(getattr(c.delta, "reasoning_content", None) for c in streamed)


def test_a_schema_constrains_only_what_follows_the_thinking(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"prime": {"enum": ["yes", "no"]}}, "required": ["prime"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    reply = client.chat.completions.create(
        model="tiny-thinker",
        messages=[{"role": "user", "content": "Is 7 prime?"}],
        max_tokens=40,
        temperature=0,
        response_format=response_format,
        logit_bias={END: 8},
    )
    choice = reply.choices[0]
    assert choice.message.reasoning_content  # free text first: the grammar let it think
    assert choice.finish_reason == "stop" and json.loads(choice.message.content)["prime"] in ("yes", "no")


def test_the_responses_api_returns_a_reasoning_item(client: OpenAI) -> None:
    ask: dict[str, Any] = {"model": "tiny-thinker", "input": "Is 7 prime?", "max_output_tokens": 8, "temperature": 0}
    reply = client.responses.create(**ask)
    thinking, message = reply.output
    assert thinking.type == "reasoning" and thinking.content[0].type == "reasoning_text" and thinking.content[0].text
    assert message.type == "message" and reply.usage.output_tokens_details.reasoning_tokens == 8
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "reasoning" and kinds[3] == "response.reasoning_text.delta"
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thinking.content[0].text
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done + 1 : done + 3] == ["response.output_item.done", "response.output_item.added"]
    assert events[done + 2].output_index == 1 and kinds[-1] == "response.incomplete"  # cut by max_output_tokens
    assert events[-1].response.output[0].content[0].text == thinking.content[0].text
    # No effort: the template closes the section, and no reasoning item comes back.
    unthought = client.responses.create(**{**ask, "max_output_tokens": 1}, reasoning={"effort": "none"})
    assert [item.type for item in unthought.output] == ["message"]
