"""A checked ``Generation`` handed to the engine: a chat's prompt through the model's template (with its tools
and template variables), the output constraint compiled, a sequence per choice queued; the engine's refusals as
OpenAI's errors. The engine is only named for types here; the server never imports its module. No MLX.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import anyio
import structlog

from neuron import images
from neuron.engine.refusals import Overloaded, RequestError, Unavailable
from neuron.engine.sequence import Sequence
from neuron.grammar import GrammarError
from neuron.sampling_params import SamplingParams
from neuron.server.common import content, harmony, reasoning, tools
from neuron.server.common.errors import ApiError, refused
from neuron.server.common.generation import Generation
from neuron.tracing import RequestSpan

if TYPE_CHECKING:
    from neuron.engine.engine import Engine


def cancel(engine: Engine, seqs: list[Sequence]) -> None:
    for seq in seqs:
        engine.cancel(seq)


async def submit(
    engine: Engine, gen: Generation, request_id: str, trace: RequestSpan | None = None, key: str | None = None
) -> list[Sequence]:
    """Queue a checked request in the engine, a sequence per choice, the first holding its ``trace`` (its span,
    where traces are on), each its API ``key``'s name (None: the server asks none); refusals as OpenAI's errors."""
    structlog.contextvars.bind_contextvars(request_id=request_id)
    if trace is not None:
        structlog.contextvars.bind_contextvars(trace_id=trace.trace_id)
    try:
        return await _submit(engine, gen, request_id, trace, key)
    except BaseException as e:
        if trace is not None:
            trace.refused(str(e))
        raise


async def _submit(
    engine: Engine, gen: Generation, request_id: str, trace: RequestSpan | None, key: str | None
) -> list[Sequence]:
    chat = gen.chat
    text = engine.text
    seqs: list[Sequence] = []
    try:
        if chat:
            prompts = [await chat_prompt_with_images(engine, gen)]
            gen.params = reasoning.chat_params(text.tokenizer, gen.params)
        else:
            prompts = [p if isinstance(p, list) else text.encode(p) for p in gen.prompts]
        for i, prompt in enumerate(prompts):
            try:
                params = await _constrained(engine, gen, prompt)
                first = trace if i == 0 else None  # the span ends with the first prompt's first choice
                seq = engine.submit(prompt, params, request_id, gen.n, gen.adapter, gen.priority, first, key)
            except RequestError as e:
                if e.param == "prompt" and len(prompts) > 1:
                    e.param = f"prompt[{i}]"
                raise
            seqs += [seq, *seq.copies]
    except RequestError as e:
        cancel(engine, seqs)
        raise request_error(e, chat=chat) from e
    except (Overloaded, Unavailable) as e:
        cancel(engine, seqs)
        raise refused(e) from e
    return seqs


def request_error(error: RequestError, *, chat: bool) -> ApiError:
    """The engine's refusal of a request as a 400; a chat's prompt is its ``messages``."""
    param = "messages" if chat and error.param == "prompt" else error.param
    return ApiError(400, str(error), param=param, code=error.code)


def chat_prompt(engine: Engine, gen: Generation) -> list[int]:
    """A chat's prompt: its tools and template variables through the model's template."""
    text = engine.text
    if reasoning.harmony(text.tokenizer):
        return harmony.prompt(text, gen.messages, gen.tools, gen.reasoning)
    messages = tools.template_messages(gen.messages, gen.tools, text.tool_markup)
    specs = gen.tools.specs if gen.tools and text.tool_markup else None
    kwargs = reasoning.template_kwargs(
        gen.reasoning, text.tokenizer.chat_template, reasoning.Thinking.of(text.tokenizer)
    )
    return reasoning.encode_chat(text, messages, specs, kwargs)


async def chat_prompt_with_images(engine: Engine, gen: Generation) -> list[int]:
    """``chat_prompt``, where the chat carries images once they are read (fetched, decoded) and with the model's
    processor run over them on a worker thread: a large photo takes seconds the event loop must not wait out. A
    text-only model refuses the images unread."""
    if engine.text.vision is None or not images.image_parts(gen.messages):
        return chat_prompt(engine, gen)
    await content.read_images(gen.messages)
    return await content.off_loop(chat_prompt, engine, gen)


async def _constrained(engine: Engine, gen: Generation, prompt: list[int]) -> SamplingParams:
    """The request's sampling parameters with its output constraint compiled in, if it has one. A thinking
    model's chat thinks first, unconstrained, and the constraint holds what follows its thinking section."""
    schema, param = gen.schema, "response_format"
    if schema is None and gen.tools is not None:
        schema, param = gen.tools.schema(), "tools"
    if schema is None:
        return gen.params
    try:
        # On a thread: a large schema takes up to a few hundred ms to compile (bounded by grammar.LIMITS).
        tokenizer = engine.text.tokenizer
        around = reasoning.grammar(tokenizer, prompt) if gen.chat else None
        if gen.chat and reasoning.harmony(tokenizer):  # the constraint holds only its own message
            tools = gen.tools if param == "tools" else None
            around = harmony.grammar(tokenizer, tools, engine.limits.constrained_reasoning_tokens)
        constraint = await anyio.to_thread.run_sync(engine.grammars.compile, schema, around)
    except GrammarError as e:
        message = f"`{param}`: the schema cannot be enforced: {e}; remove or rewrite that part of the schema"
        raise ApiError(400, message, param=param, code="unsupported_schema") from e
    return dataclasses.replace(gen.params, constraint=constraint)
