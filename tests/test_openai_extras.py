"""What else OpenAI clients and benchmark tools send: vLLM's sampling extensions, through the official client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import Server, serving

EOS = 2  # "<|im_end|>" in the tiny models' tokenizer
IM_START = 1  # "<|im_start|>": special, not an end


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory, "--model", str(tiny_models["qwen3"])) as server:
        yield server


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def complete(server: Server, **kwargs: object) -> openai.types.Completion:
    args = {"model": "qwen3", "prompt": "hello", "max_tokens": 12, "temperature": 0.0, **kwargs}
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


def test_unknown_fields_stay_refused(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        complete(server, extra_body={"min_token": 4})
    assert refused.value.body["param"] == "min_token"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        complete(server, extra_body={"stop_token_ids": [10**6]})
    assert refused.value.body["param"] == "stop_token_ids"  # type: ignore[index]
