"""``POST /v1/completions``: prompts (texts or token ids) continued, answered whole or streamed, one choice per
prompt and ``n``, the prompt echoed and scored on request. No MLX.
"""

from __future__ import annotations

import uuid

from starlette.responses import Response

from neuron.server.common import choices
from neuron.server.common.schema import GENERATION_ERRORS, OpenApi, Spec, post, ref, replies
from neuron.server.common.tools import ToolStream
from neuron.server.completions import parse, schema
from neuron.server.completions.render import CompletionShape
from neuron.server.http import Call, Endpoint


async def create(call: Call) -> Response:
    gen = parse.parse(call.body, call.served)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    engine = call.engine
    seqs = await call.submit(gen, request_id)
    shape = CompletionShape(gen, engine.text.token_text, engine.text.tokenizer.decode)
    replies_ = choices.Replies(gen, request_id, shape)
    readers: list[ToolStream | None] = [None] * len(seqs)  # tools are the chat route's
    if gen.stream:
        return call.stream(seqs, choices.stream(seqs, gen, replies_, readers))
    return await call.answer(seqs, lambda: choices.collect(seqs, replies_, readers))


ENDPOINTS = (Endpoint("/v1/completions", create, strict_json=True, generates=True),)


def openapi(spec: Spec) -> OpenApi:
    ok = replies(*GENERATION_ERRORS, ok=ref("Completion"), stream=True)
    paths = {"/v1/completions": post(spec, "a text completion, whole or streamed", schema.request(spec), ok)}
    return paths, {"Completion": schema.reply(spec.model_id)}
