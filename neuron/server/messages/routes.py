"""Anthropic's Messages API: the chat a Messages body describes, answered as a Message, whole or as its stream of
events, and the prompt tokens it would take (``count_tokens``). Errors in Anthropic's shape. No MLX.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.responses import Response

from neuron.engine.refusals import RequestError
from neuron.server.common import chat, harmony
from neuron.server.common.errors import ApiError
from neuron.server.common.generation import Generation
from neuron.server.common.schema import OpenApi, Spec, integer, post, replies_with
from neuron.server.common.submit import chat_prompt_with_images, request_error
from neuron.server.http import Call, Endpoint, OrjsonResponse
from neuron.server.messages import parse, render, schema


def _chat(body: Any, served_model: str, counting: bool = False) -> Generation:
    try:
        return chat.parse(parse.to_chat(body, counting=counting), served_model)
    except ApiError as e:
        raise parse.renamed(e) from None


async def create(call: Call) -> Response:
    gen = _chat(call.body, call.served)
    request_id = f"msg_{uuid.uuid4().hex}"
    engine = call.engine
    seqs = await call.submit(gen, request_id)
    (seq,) = seqs
    split = harmony.splitter(engine.text.tokenizer, seq.prompt)
    reader = harmony.reader(gen.tools, engine.text.tool_markup, split)
    if gen.stream:
        return call.stream(seqs, render.events(seq, gen, request_id, split, reader))
    return await call.answer(seqs, lambda: render.collect(seq, gen, request_id, split, reader))


async def count_tokens(call: Call) -> Response:
    gen = _chat(call.body, call.served, counting=True)
    try:
        prompt = await chat_prompt_with_images(call.engine, gen)
    except RequestError as e:
        raise request_error(e, chat=True) from e
    return OrjsonResponse({"input_tokens": len(prompt)})


ENDPOINTS = (
    Endpoint("/v1/messages", create, strict_json=True, generates=True, error_body=render.error_body, images=True),
    Endpoint("/v1/messages/count_tokens", count_tokens, error_body=render.error_body, images=True),
)


def openapi(spec: Spec) -> OpenApi:
    message = schema.message_reply(spec.model_id)
    counted = {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": integer(0)}}
    paths = {
        "/v1/messages": post(
            spec,
            "a message (Anthropic's Messages API), whole or streamed",
            schema.messages_request(spec.model_id),
            replies_with(schema.ERROR, message, stream=True),
        ),
        "/v1/messages/count_tokens": post(
            spec,
            "the prompt tokens of a Messages API request",
            schema.messages_request(spec.model_id, counting=True),
            replies_with(schema.ERROR, counted),
        ),
    }
    return paths, {}
