"""``POST /v1/responses``: the chat a Responses body describes, answered as a Response, whole or as its stream of
typed events. Stateless. No MLX.
"""

from __future__ import annotations

import uuid

from starlette.responses import Response

from neuron.server.common import chat, harmony
from neuron.server.common.errors import ApiError
from neuron.server.common.schema import GENERATION_ERRORS, OpenApi, Spec, post, replies
from neuron.server.http import Call, Endpoint
from neuron.server.responses import parse, render, schema


async def create(call: Call) -> Response:
    try:
        gen = chat.parse(parse.to_chat(call.body), call.served)
    except ApiError as e:
        raise parse.renamed(e) from None
    request_id = f"resp_{uuid.uuid4().hex}"
    engine = call.engine
    seqs = await call.submit(gen, request_id)
    (seq,) = seqs
    split = harmony.splitter(engine.text.tokenizer, seq.prompt)
    replies_ = render.ResponseReplies(gen, call.body, request_id, split)
    reader = harmony.reader(gen.tools, engine.text.tool_markup, split)
    if gen.stream:

        def error_event(e: ApiError) -> bytes:
            return render.sse(replies_.event("error", code=e.code, message=e.message, param=None))

        return call.stream(seqs, render.events(seq, replies_, reader), error_event)
    return await call.answer(seqs, lambda: render.collect(seq, replies_, reader))


ENDPOINTS = (Endpoint("/v1/responses", create, strict_json=True, generates=True, images=True),)


def openapi(spec: Spec) -> OpenApi:
    ok = replies(*GENERATION_ERRORS, ok=schema.reply(spec.model_id), stream=True)
    summary = "a response (OpenAI's Responses API), whole or streamed; stateless"
    return {"/v1/responses": post(spec, summary, schema.request(spec.model_id, spec.reasons), ok)}, {}
