"""``POST /v1/chat/completions``: a chat through the model's template, answered whole or streamed, one choice per
sequence (``n``), with tool calls and a thinking model's reasoning split out. No MLX.
"""

from __future__ import annotations

import uuid

from starlette.responses import Response

from neuron.server.chat_completions import schema
from neuron.server.chat_completions.render import ChatShape
from neuron.server.common import chat, choices, harmony
from neuron.server.common.schema import GENERATION_ERRORS, OpenApi, Spec, post, ref, replies
from neuron.server.http import Call, Endpoint


async def create(call: Call) -> Response:
    gen = chat.parse(call.body, call.served)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    engine = call.engine
    seqs = await call.submit(gen, request_id)
    text = engine.text
    replies_ = choices.Replies(gen, request_id, ChatShape(gen, text.token_text))
    splits = [harmony.splitter(text.tokenizer, seq.prompt) for seq in seqs]
    readers = [harmony.reader(gen.tools, text.tool_markup, split) for split in splits]
    if gen.stream:
        return call.stream(seqs, choices.stream(seqs, gen, replies_, readers, splits))
    return await call.answer(seqs, lambda: choices.collect(seqs, replies_, readers, splits))


ENDPOINTS = (Endpoint("/v1/chat/completions", create, strict_json=True, generates=True, images=True),)


def openapi(spec: Spec) -> OpenApi:
    ok = replies(*GENERATION_ERRORS, ok=ref("ChatCompletion"), stream=True)
    paths = {"/v1/chat/completions": post(spec, "a chat completion, whole or streamed", schema.request(spec), ok)}
    return paths, {"ChatCompletion": schema.reply(spec.model_id)}
