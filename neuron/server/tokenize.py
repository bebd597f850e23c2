"""vLLM's ``/tokenize`` and ``/detokenize``: the served model's tokenizer, for benchmark and routing tools that
count or build prompts in tokens. Request and reply shapes are vLLM's. No MLX, no HTTP.

A chat is rendered by the model's template to text and then encoded, as vLLM does, so ``add_special_tokens``
(default false for a chat, whose template writes its own) means the same for both kinds of request.
"""

from __future__ import annotations

from typing import Any

from neuron.server import reasoning, tools
from neuron.server.openai_api import ApiError, _is_int64, _kind, _messages, bad

PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "add_special_tokens",
        "return_token_strs",
        "add_generation_prompt",
        "tools",
        "chat_template_kwargs",
    }
)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not bool:
        raise bad(name, f"`{name}` must be a boolean, got {_kind(value)}", "invalid_type")
    return value


def _check(body: Any, fields: frozenset[str], served_model: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_kind(body)}", code="invalid_body")
    for name in body:
        if name not in fields:
            raise bad(name, f"unrecognized request argument `{name}`", "unknown_parameter")
    model = body.get("model")
    if model is not None and model != served_model:
        message = f"the model `{model}` does not exist; this server serves `{served_model}`"
        raise ApiError(404, message, param="model", code="model_not_found")
    return body


def tokenize(text: Any, body: Any, served_model: str, max_model_len: int) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens", "token_strs"}`` for a ``prompt`` or a chat's ``messages``."""
    chat = isinstance(body, dict) and "messages" in body
    body = _check(body, CHAT_FIELDS if chat else PROMPT_FIELDS, served_model)
    tokenizer = text.tokenizer
    add_special = _flag(body, "add_special_tokens", not chat)
    if chat:
        rendered = _render(text, body)
    else:
        rendered = body.get("prompt")
        if not isinstance(rendered, str):
            raise bad("prompt", f"`prompt` (or `messages`) is required: a string, got {_kind(rendered)}")
    ids = [int(t) for t in tokenizer.encode(rendered, add_special_tokens=add_special)]
    strs = tokenizer.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def _render(text: Any, body: dict[str, Any]) -> str:
    """The chat as the model's template writes it, with the tools and template variables a chat request sends."""
    messages = _messages(body.get("messages"))
    parsed = tools.parse({k: body[k] for k in ("tools",) if k in body})
    messages = tools.template_messages(messages, parsed, text.tool_markup)
    specs = parsed.specs if parsed and text.tool_markup else None
    kwargs = reasoning.parse(body).template_kwargs
    generation = _flag(body, "add_generation_prompt", True)
    if not text.tokenizer.chat_template:
        raise bad("messages", f"{text.model_name} has no chat template; send `prompt` instead")
    try:
        return text.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=generation,
            **({"tools": specs} if specs else {}),
            **kwargs,
        )
    except Exception as e:  # a template raises what its author wrote (jinja2 exceptions, raise_exception)
        raise bad("messages", f"the model's chat template rejected the messages: {e}") from e


def detokenize(text: Any, body: Any, served_model: str, vocab_size: int) -> dict[str, Any]:
    """``{"prompt"}``: the text of ``tokens``."""
    body = _check(body, frozenset({"model", "tokens"}), served_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int64(t) for t in tokens):
        raise bad("tokens", f"`tokens` must be an array of token ids, got {_kind(tokens)}")
    if bad_ids := [t for t in tokens if not 0 <= t < vocab_size]:
        raise bad("tokens", f"`tokens` holds ids outside [0, {vocab_size}): {bad_ids[:5]}")
    return {"prompt": text.tokenizer.decode([int(t) for t in tokens])}
