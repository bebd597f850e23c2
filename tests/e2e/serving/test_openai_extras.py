"""What else OpenAI clients and benchmark tools send, through the official client: the Responses API and vLLM's
sampling extensions."""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from testkit import TOOLS_TEMPLATE, Server, serving, with_template

EOS = 2  # "<|im_end|>" in the tiny models' tokenizer
IM_START = 1  # "<|im_start|>": special, not an end
MODEL = "qwen3"


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A template that shows tools, so that Responses' function tools can be asked for too.
    model = with_template(tiny_models["qwen3"], tmp_path_factory.mktemp("tools") / "qwen3", TOOLS_TEMPLATE)
    with serving(tmp_path_factory, "--model", str(model)) as server:
        yield server


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def complete(server: Server, **kwargs: object) -> openai.types.Completion:
    args = {"model": MODEL, "prompt": "hello", "max_tokens": 12, "temperature": 0.0, **kwargs}
    return client(server).completions.create(**args)  # type: ignore[call-overload]


FORCE_EOS = {"logit_bias": {str(EOS): 100}}


def test_ignore_eos_reaches_exactly_max_tokens(server: Server) -> None:
    stopped = complete(server, **FORCE_EOS)
    assert (stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("stop", 0)
    ignored = complete(server, **FORCE_EOS, extra_body={"ignore_eos": True})
    assert (ignored.choices[0].finish_reason, ignored.usage.completion_tokens) == ("length", 12)
    # The end-of-sequence token is special: left out of the text unless asked for.
    assert ignored.choices[0].text == ""
    shown = complete(server, **FORCE_EOS, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert shown.choices[0].text == "<|im_end|>" * 12


def test_min_tokens_holds_back_eos_and_stop_token_ids(server: Server) -> None:
    held = complete(server, **FORCE_EOS, extra_body={"min_tokens": 4})
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 4)
    forced = {"logit_bias": {str(IM_START): 100}}
    ended = complete(server, **forced, extra_body={"stop_token_ids": [IM_START]})
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 0)
    late = complete(server, **forced, extra_body={"stop_token_ids": [IM_START], "min_tokens": 3})
    assert (late.choices[0].finish_reason, late.usage.completion_tokens) == ("stop", 3)
    with pytest.raises(openai.BadRequestError) as refused:
        complete(server, max_tokens=2, extra_body={"min_tokens": 3})
    assert refused.value.body["param"] == "min_tokens"  # type: ignore[index]
    assert refused.value.body["code"] == "min_tokens_above_max_tokens"  # type: ignore[index]


def test_include_stop_str_in_output(server: Server) -> None:
    text = complete(server, max_tokens=16).choices[0].text
    stop = text[5:7]
    cut = text[: text.index(stop)]
    assert complete(server, max_tokens=16, stop=[stop]).choices[0].text == cut
    kept = complete(server, max_tokens=16, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert (kept.choices[0].text, kept.choices[0].finish_reason) == (cut + stop, "stop")
    # min_tokens holds stop strings back too, as vLLM's does: the whole 16 tokens come out.
    late = complete(server, max_tokens=16, stop=[stop], extra_body={"min_tokens": 16})
    assert (late.choices[0].text, late.choices[0].finish_reason) == (text, "length")


def test_unknown_fields_stay_refused(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        complete(server, extra_body={"min_token": 4})
    assert refused.value.body["param"] == "min_token"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        complete(server, extra_body={"stop_token_ids": [10**6]})
    assert refused.value.body["param"] == "stop_token_ids"  # type: ignore[index]


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]},
}


def test_responses_whole_and_streamed_agree_with_chat(server: Server) -> None:
    args = {"model": MODEL, "instructions": "Be brief.", "max_output_tokens": 10, "temperature": 0.0}
    chat = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
        max_tokens=10,
        temperature=0.0,
    )
    whole = client(server).responses.create(input="hello there", **args)  # type: ignore[arg-type]
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens == 10
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    # A message list says the same as the text.
    listed = [{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}]
    assert client(server).responses.create(input=listed, **args).output_text == whole.output_text  # type: ignore[arg-type]

    events = list(client(server).responses.create(input="hello there", stream=True, **args))  # type: ignore[arg-type]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text and events[-1].response.usage == whole.usage


def test_responses_function_tools(server: Server) -> None:
    args = {
        "model": MODEL,
        "input": "weather in Paris?",
        "tools": [WEATHER],
        "max_output_tokens": 40,
        "temperature": 0.0,
    }
    forced = {"type": "function", "name": "get_weather"}
    whole = client(server).responses.create(**args, tool_choice=forced)  # type: ignore[arg-type]
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")

    events = list(client(server).responses.create(**args, tool_choice=forced, stream=True))  # type: ignore[arg-type]
    assert [e.type for e in events][2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-1].response.output[0].arguments == call.arguments

    # The call and its output go back as items: the next turn reads them through the template.
    follow = [
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    after = client(server).responses.create(model=MODEL, input=follow, max_output_tokens=1)  # type: ignore[arg-type]
    calls = [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]
    messages = [
        follow[0],
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    chat = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert after.usage.input_tokens == chat.usage.prompt_tokens > 20


def test_responses_refusals_name_the_field(server: Server) -> None:
    def refused(**body: object) -> dict:
        response = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", **body})
        assert response.status_code == 400, response.text
        return response.json()["error"]

    assert refused(previous_response_id="resp_1")["param"] == "previous_response_id"
    assert refused(max_output_tokens=0)["param"] == "max_output_tokens"
    assert refused(input=[{"role": "robot", "content": "x"}])["param"] == "input[0].role"
    assert refused(tools=[{"type": "web_search"}])["param"] == "tools[0]"
    assert refused(frobnicate=1)["param"] == "frobnicate"


def _prefilled(server: Server) -> float:
    return server.metrics()[("neuron_prefill_tokens_total", ())]


def test_n_computes_the_prompt_once_and_each_choice_is_its_derived_seed(server: Server) -> None:
    args = {"prompt": "hello there", "max_tokens": 12, "temperature": 1.0, "seed": 7}
    before = _prefilled(server)
    four = complete(server, n=4, **args)
    # One prompt of 11 byte tokens, computed once (less what the prefix cache restored).
    assert four.usage.prompt_tokens == 11
    assert _prefilled(server) - before == 11 - four.usage.prompt_tokens_details.cached_tokens > 0
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    texts = [c.text for c in four.choices]
    assert len(set(texts)) > 1  # sampled independently
    assert four.usage.completion_tokens == 4 * 12
    assert [c.text for c in complete(server, n=4, **args).choices] == texts  # reproducible
    # Choice i is what a request alone with seed 7 + i gets.
    assert [complete(server, **{**args, "seed": 7 + i}).choices[0].text for i in range(4)] == texts

    streamed: dict[int, str] = {}
    for chunk in client(server).completions.create(model=MODEL, n=4, stream=True, **args):  # type: ignore[call-overload]
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(4)] == texts

    chat = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6, seed=3
    )
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content is not None for c in chat.choices)


def test_prompt_lists_give_a_choice_per_prompt_times_n(server: Server, tiny_models: dict[str, Path]) -> None:
    prompts = ["One", "Two", "Three"]
    alone = [complete(server, prompt=p).choices[0].text for p in prompts]
    listed = complete(server, prompt=prompts)
    assert [c.index for c in listed.choices] == [0, 1, 2]
    assert [c.text for c in listed.choices] == alone
    assert listed.usage.prompt_tokens == sum(map(len, prompts))
    one = AutoTokenizer.from_pretrained(tiny_models["qwen3"]).encode("One")
    doubled = complete(server, prompt=[one, "Two"], n=2)
    assert [c.index for c in doubled.choices] == [0, 1, 2, 3]
    assert [c.text for c in doubled.choices] == [alone[0], alone[0], alone[1], alone[1]]  # greedy: copies agree


def _ascii(tokenizer: AutoTokenizer) -> list[int]:
    return [tokenizer.encode(c)[0] for c in string.ascii_letters + " "]


def _mlx_lm_logprobs(model_path: Path, ids: list[int]) -> list[float]:
    """What mlx-lm itself says each token's log-probability is, given the ones before it."""
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(model_path))
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


@pytest.fixture(scope="module")
def chunked(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two ranks, prompts fed 5 tokens a step: scoring crosses chunks and ranks."""
    args = ("--model", str(tiny_models["qwen3"]), "--tp", "2", "--prefill-chunk", "5")
    with serving(tmp_path_factory, *args) as server:
        yield server


@pytest.fixture(scope="module")
def pipelined(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two pipeline stages: the last sends every scored position back to rank 0."""
    args = ("--model", str(tiny_models["qwen3"]), "--pp", "2", "--prefill-chunk", "5")
    with serving(tmp_path_factory, *args) as server:
        yield server


@pytest.mark.parametrize("where", ["server", "chunked", "pipelined"])
def test_echo_scores_the_prompt_as_generation_and_mlx_lm_do(
    where: str, request: pytest.FixtureRequest, tiny_models: dict[str, Path]
) -> None:
    served: Server = request.getfixturevalue(where)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    prompt = tokenizer.encode("hello there")
    # Only letters may be chosen (each one token), so the text maps back to its tokens; logprobs are the model's own.
    letters = {str(t): 100 for t in _ascii(tokenizer)}
    made = complete(served, prompt=prompt, max_tokens=8, logprobs=0, logit_bias=letters).choices[0]
    generated = tokenizer.encode(made.text)
    assert len(generated) == 8

    scored = complete(served, prompt=prompt + generated, max_tokens=0, echo=True, logprobs=2)
    (choice,) = scored.choices
    assert choice.text == "hello there" + made.text and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens == [tokenizer.decode([t]) for t in prompt + generated]
    assert logprobs.text_offset == list(range(len(prompt) + 8))
    assert sum(logprobs.token_logprobs[-8:]) == pytest.approx(sum(made.logprobs.token_logprobs), abs=1e-3)
    assert logprobs.token_logprobs[-8:] == pytest.approx(made.logprobs.token_logprobs, abs=1e-3)
    assert logprobs.token_logprobs[1:] == pytest.approx(
        _mlx_lm_logprobs(tiny_models["qwen3"], prompt + generated), abs=1e-3
    )
    for chosen, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True):
        # Two alternatives, keyed by text: two byte tokens that decode alike ("\ufffd") share a key.
        assert 1 <= len(top) <= 2 and max(top.values()) >= chosen - 1e-5

    # Echoed with a completion after it, streamed too: the prompt comes first, then what is generated.
    echoed = complete(served, prompt=prompt, max_tokens=8, echo=True, logit_bias=letters).choices[0]
    assert echoed.text == "hello there" + made.text
    pieces = complete(served, prompt=prompt, max_tokens=8, echo=True, logit_bias=letters, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == echoed.text


def test_n_over_two_ranks_with_a_chunked_prompt(chunked: Server) -> None:
    args = {"prompt": "a prompt fed in chunks", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    before = _prefilled(chunked)
    three = complete(chunked, n=3, **args)
    assert _prefilled(chunked) - before == three.usage.prompt_tokens - three.usage.prompt_tokens_details.cached_tokens
    assert [c.text for c in three.choices] == [
        complete(chunked, **{**args, "seed": 11 + i}).choices[0].text for i in range(3)
    ]


ITEMS = [  # (question, choices): multiple-choice items, scored as lm-evaluation-harness scores them
    ("The sky is", [" blue", " green", " loud"]),
    ("Two and two make", [" four", " five"]),
    ("Paris is in", [" France", " Spain", " Peru", " Mars"]),
]


def test_lm_evaluation_harness_scores_as_mlx_lm_does(server: Server, tiny_models: dict[str, Path]) -> None:
    """lm-evaluation-harness's own `local-completions` model (echo, logprobs, a list of token prompts) against
    the server, and the same log-likelihoods from mlx-lm directly."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    lm = get_model("local-completions")(
        base_url=f"{server.url}/v1/completions",
        model=MODEL,
        tokenizer=str(tiny_models["qwen3"]),
        tokenizer_backend="huggingface",
        batch_size=4,
        max_retries=1,
    )
    pairs = [(question, choice) for question, choices in ITEMS for choice in choices]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    scores = [ll for ll, _ in lm.loglikelihood(requests)]

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    expected = []
    for question, choice in pairs:
        context, continuation = tokenizer.encode(question), tokenizer.encode(choice)
        per_token = _mlx_lm_logprobs(tiny_models["qwen3"], context + continuation)
        expected.append(sum(per_token[len(context) - 1 :]))
    assert scores == pytest.approx(expected, abs=1e-3)
