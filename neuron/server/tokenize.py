"""vLLM's ``/tokenize`` and ``/detokenize``: the served model's tokenizer, for benchmark and routing tools that
count or build prompts in tokens. Request and reply shapes are vLLM's; the routes and their OpenAPI paths beside
them. No MLX.

A chat is rendered by the model's template to text and then encoded, as vLLM does, so ``add_special_tokens``
(default false for a chat, whose template writes its own) means the same for both kinds of request.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from neuron.server.common import fields, harmony, reasoning, tools
from neuron.server.common.chat import messages, messages_schema
from neuron.server.common.errors import bad
from neuron.server.common.reasoning import TEMPLATE_KWARGS
from neuron.server.common.schema import OpenApi, Schema, Spec, or_null, post, ref, replies_with, served_names, token_ids
from neuron.server.http import Call, Endpoint, OrjsonResponse

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
        raise bad(name, f"`{name}` must be a boolean, got {fields.type_of(value)}", "invalid_type")
    return value


def _check(body: Any, known: frozenset[str], served_model: str) -> dict[str, Any]:
    body = fields.an_object(body)
    fields.known(body, known)
    fields.served(body.get("model"), served_model)
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
            raise bad("prompt", f"`prompt` (or `messages`) is required: a string, got {fields.type_of(rendered)}")
    ids = [int(t) for t in tokenizer.encode(rendered, add_special_tokens=add_special)]
    strs = tokenizer.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def _render(text: Any, body: dict[str, Any]) -> str:
    """The chat as the model's template writes it, with the tools and template variables a chat request sends."""
    parsed = tools.parse({k: body[k] for k in ("tools",) if k in body})
    chat = tools.template_messages(messages(body.get("messages")), parsed, text.tool_markup)
    specs = parsed.specs if parsed and text.tool_markup else None
    kwargs = reasoning.parse(body).template_kwargs
    generation = _flag(body, "add_generation_prompt", True)
    if generation and reasoning.harmony(text.tokenizer):  # as a chat request's prompt is rendered
        return harmony.render(messages(body.get("messages")), parsed, reasoning.parse(body))
    if not text.tokenizer.chat_template:
        raise bad("messages", f"{text.model_name} has no chat template; send `prompt` instead")
    try:
        return text.tokenizer.apply_chat_template(
            chat,
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
    if not isinstance(tokens, list) or not all(fields.is_int64(t) for t in tokens):
        raise bad("tokens", f"`tokens` must be an array of token ids, got {fields.type_of(tokens)}")
    if bad_ids := [t for t in tokens if not 0 <= t < vocab_size]:
        raise bad("tokens", f"`tokens` holds ids outside [0, {vocab_size}): {bad_ids[:5]}")
    return {"prompt": text.tokenizer.decode([int(t) for t in tokens])}


async def tokenize_text(call: Call) -> Response:
    engine = call.engine
    return OrjsonResponse(tokenize(engine.text, call.body, call.served, engine.context_length))


async def detokenize_tokens(call: Call) -> Response:
    engine = call.engine
    return OrjsonResponse(detokenize(engine.text, call.body, call.served, engine.vocab_size))


ENDPOINTS = (Endpoint("/tokenize", tokenize_text, images=True), Endpoint("/detokenize", detokenize_tokens))


# The OpenAPI pieces of these routes, beside the checks they describe.


def openapi(spec: Spec) -> OpenApi:
    chat_tools = tools.request_properties()["tools"]
    text = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
    paths = {
        "/tokenize": post(
            spec,
            "a prompt or a chat as the model's tokens (vLLM's)",
            tokenize_request(spec.model_id, messages_schema(spec.context), chat_tools),
            replies_with(ref("Error"), tokenize_reply()),
        ),
        "/detokenize": post(
            spec,
            "token ids as text (vLLM's)",
            detokenize_request(spec.model_id, spec.vocab_size),
            replies_with(ref("Error"), text),
        ),
    }
    return paths, {}


def tokenize_request(model_id: str, chat_messages: Schema, tools: Schema) -> Schema:
    common = {
        "model": or_null({"type": "string", "enum": served_names(model_id)}),
        "add_special_tokens": or_null({"type": "boolean"}),
        "return_token_strs": or_null({"type": "boolean"}),
    }
    prompt = {
        "type": "object",
        "required": ["prompt"],
        "properties": common | {"prompt": {"type": "string"}},
        "additionalProperties": False,
    }
    chat = {
        "type": "object",
        "required": ["messages"],
        "properties": common
        | {
            "messages": chat_messages,
            "add_generation_prompt": or_null({"type": "boolean"}),
            "tools": tools,
            "chat_template_kwargs": or_null(TEMPLATE_KWARGS),
        },
        "additionalProperties": False,
    }
    return {"anyOf": [prompt, chat], "description": "a prompt, or a chat rendered by the model's template"}


def tokenize_reply() -> Schema:
    return {
        "type": "object",
        "required": ["count", "max_model_len", "tokens", "token_strs"],
        "properties": {
            "count": {"type": "integer", "minimum": 0},
            "max_model_len": {"type": "integer", "minimum": 1},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
        },
    }


def detokenize_request(model_id: str, vocab_size: int | None) -> Schema:
    return {
        "type": "object",
        "required": ["tokens"],
        "properties": {
            "model": or_null({"type": "string", "enum": served_names(model_id)}),
            "tokens": {"type": "array", "items": token_ids(vocab_size)},
        },
        "additionalProperties": False,
    }
