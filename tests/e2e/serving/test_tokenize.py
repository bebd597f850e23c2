"""vLLM's /tokenize and /detokenize against a served model (conftest's thinking_server), checked against the
model's own tokenizer loaded here through mlx-lm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit import Server

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(thinking_server: Server) -> Any:
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(Path(thinking_server.args[thinking_server.args.index("--model") + 1]))


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_a_prompt_and_a_chat_become_the_models_tokens(thinking_server: Server, tokenizer: Any) -> None:
    reply = post(thinking_server, "/tokenize", {"model": "tiny-thinker", "prompt": "hi <think>"}).json()
    assert reply == {"count": 4, "max_model_len": 2048, "tokens": tokenizer.encode("hi <think>"), "token_strs": None}
    chat = post(thinking_server, "/tokenize", {"messages": CHAT, "return_token_strs": True}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert chat["token_strs"][-2:] == ["<think>", "Ċ"] and chat["count"] == len(chat["tokens"])
    # The template's variables and the generation prompt, as a chat request gives them.
    closed = post(thinking_server, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert closed.json()["count"] == chat["count"] + 4
    bare = post(thinking_server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tokenizer.apply_chat_template(CHAT, add_generation_prompt=False)


def test_detokenize_gives_the_text_back(thinking_server: Server, tokenizer: Any) -> None:
    tokens = tokenizer.encode("héllo </think>")
    assert post(thinking_server, "/detokenize", {"tokens": tokens}).json() == {"prompt": "héllo </think>"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "hi", "echo": True}, "echo"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ],
)
def test_bad_requests_name_the_field(thinking_server: Server, path: str, body: dict[str, Any], param: str) -> None:
    reply = post(thinking_server, path, body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_another_model_is_not_found(thinking_server: Server) -> None:
    reply = post(thinking_server, "/tokenize", {"model": "another", "prompt": "hi"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
