"""Replies made of choices (chat completions and completions), one choice per sequence: whole, or streamed as
chunks that carry each choice's ``index``. The loops are here; each family's ``render`` gives a choice its
shape (a ``Shape``, which ``Replies`` holds). No MLX, no HTTP.

A request's choices are its prompts times ``n``, indexed as OpenAI does (prompt i's choice j is i * n + j);
they decode together in the batch, so their events interleave step by step.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from neuron.engine.sequence import Chunk, Event, Failure, Finish, Sequence
from neuron.server.common import tools
from neuron.server.common.errors import failure_error, no_answer
from neuron.server.common.generation import Generation
from neuron.server.common.reasoning import ReasoningSplit
from neuron.server.common.schema import Schema, served_names
from neuron.server.common.tools import ToolStream
from neuron.server.keepalive import sse


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    accepted: int = 0,
    rejected: int = 0,
    reasoning: int = 0,
) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` counts the prompt tokens the prefix cache restored, ``accepted``
    and ``rejected`` the draft tokens speculation kept and threw away (from ``prediction`` or prompt lookup),
    ``reasoning`` the completion tokens of a thinking section."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": rejected,
            "reasoning_tokens": reasoning,
        },
    }


@dataclass(frozen=True, slots=True)
class Said:
    """What one choice says: its text, whether more is to come, its tool calls and its reasoning."""

    text: str
    going_on: bool
    tool_calls: list[dict[str, Any]] | None
    reasoning: str | None


class Shape(Protocol):
    """What differs between the families whose replies are made of choices (``chat_completions.render``,
    ``completions.render``); the loops here and the envelope are the same for both."""

    def kind(self, chunk: bool) -> str:
        """The envelope's ``object``, whole or (``chunk``) streamed."""

    def logprobs(self, chunks: list[Chunk], index: int) -> dict[str, Any] | None:
        """The scores of choice ``index``'s tokens, in this family's shape; None unless the request asked."""

    def said(self, said: Said, delta: bool) -> dict[str, Any]:
        """What a choice holds besides its index, logprobs and finish reason."""

    def echo(self, seq: Sequence, index: int) -> tuple[str, dict[str, Any] | None]:
        """The prompt's text and its scores, before the completion: only completions echo."""

    def opening(self, index: int) -> dict[str, Any] | None:
        """The choice a streamed choice opens with, if this family's stream has one."""


class Replies:
    """Builds one request's reply objects: the envelope and the choices in it; ``shape`` is what the family
    (chat completions or completions) writes differently."""

    def __init__(self, gen: Generation, request_id: str, shape: Shape) -> None:
        self.gen = gen
        self.id = request_id
        self.created = int(time.time())
        self.shape = shape
        self.shows_reasoning = gen.reasoning is None or gen.reasoning.include  # vLLM's include_reasoning

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None,
        *,
        delta: bool,
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        """One choice, whole or (``delta``) as a streamed chunk's piece; ``reasoning`` (a thinking model's, unless
        the request left it out) as vLLM's ``reasoning_content``."""
        said = self.shape.said(Said(text, finish_reason is None, tool_calls, reasoning), delta)
        return {"index": index, **said, "logprobs": logprobs, "finish_reason": finish_reason}

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self.shape.kind(chunk), "created": self.created, "model": self.gen.model}

    def chunk(self, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {**self._envelope(chunk=True), "choices": choices}
        if self.gen.include_usage:
            out["usage"] = usage_
        return out

    def whole(self, choices: list[dict[str, Any]], usage_: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(chunk=False), "choices": choices, "usage": usage_}


def _usage(seqs: list[Sequence], splits: list[ReasoningSplit | None] | None = None) -> dict[str, Any]:
    """Each prompt counted once, however many choices share it, as OpenAI counts them."""
    originals = [seq for seq in seqs if seq.copy_of is None]
    prompts, cached = sum(len(seq.prompt) for seq in originals), sum(seq.cached for seq in originals)
    proposed = sum(seq.proposer.proposed for seq in seqs if seq.proposer)
    accepted = sum(seq.proposer.accepted for seq in seqs if seq.proposer)
    reasoning = sum(split.tokens for split in splits or () if split)
    return usage(prompts, sum(seq.completion_tokens for seq in seqs), cached, accepted, proposed - accepted, reasoning)


def joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions logprobs objects, one after the other."""
    if a is None or b is None:
        return a or b
    return {key: a[key] + b[key] for key in a}


async def collect(
    seqs: list[Sequence],
    replies: Replies,
    readers: list[ToolStream | None],
    splits: list[ReasoningSplit | None] | None = None,
) -> dict[str, Any]:
    """The whole reply. ``splits``: a thinking model's, one per choice; the reasoning is split off the text
    before the tool calls are read from what remains."""
    splits = splits or [None] * len(seqs)
    choices = []
    for index, (seq, reader, split) in enumerate(zip(seqs, readers, splits, strict=True)):
        chunks: list[Chunk] = []
        async for event in seq.events:
            if isinstance(event, Chunk):
                chunks.append(event)
            elif isinstance(event, Finish):
                thought, answer = (
                    split.whole([c.text for c in chunks], event.text)
                    if split
                    else (None, "".join(c.text for c in chunks) + event.text)
                )
                text, calls, reason = tools.end(reader, answer, event.reason)
                prompt, scores = replies.shape.echo(seq, index)
                logprobs = joined(scores, replies.shape.logprobs(chunks, index))
                shown = (thought or None) if replies.shows_reasoning else None
                choice = replies.choice(
                    index, prompt + text, reason, logprobs, delta=False, tool_calls=calls, reasoning=shown
                )
                choices.append(choice)
                break
            else:
                raise failure_error(event)
        else:
            raise no_answer()
    return replies.whole(choices, _usage(seqs, splits))


async def merged(seqs: list[Sequence]) -> AsyncIterator[tuple[int, Event]]:
    """Every choice's events as they come, each with its index, until each has finished. It waits on the lowest
    unfinished choice and takes whatever the others have ready meanwhile: the batch steps them all together."""
    active = dict(enumerate(seqs))
    while active:
        first = next(iter(active))
        ready = [(first, await active[first].events.receive())]
        for index, seq in active.items():
            while index != first:
                try:
                    ready.append((index, seq.events.receive_nowait()))
                except anyio.WouldBlock:
                    break
                if not isinstance(ready[-1][1], Chunk):
                    break
        for index, event in ready:
            if not isinstance(event, Chunk):
                del active[index]
            yield index, event


async def stream(
    seqs: list[Sequence],
    gen: Generation,
    replies: Replies,
    readers: list[ToolStream | None],
    splits: list[ReasoningSplit | None] | None = None,
) -> AsyncGenerator[bytes]:
    splits = splits or [None] * len(seqs)
    for index in range(len(seqs)):
        if opening := replies.shape.opening(index):
            yield sse(replies.chunk([opening]))
    echoed: set[int] = set()
    async for index, event in merged(seqs):
        reader = readers[index]
        if gen.echo and index not in echoed:
            echoed.add(index)
            prompt, scores = replies.shape.echo(seqs[index], index)
            yield sse(replies.chunk([replies.choice(index, prompt, None, scores, delta=True)]))
        split = splits[index]
        if isinstance(event, Chunk):
            thought, answer = split.push(event.text) if split else ("", event.text)
            thought = thought if replies.shows_reasoning else ""
            text = reader.push(answer) if reader else answer
            pieces = reader.deltas() if reader else []
            if text or thought or pieces or gen.logprobs:
                logprobs = replies.shape.logprobs([event], index)
                choice = replies.choice(
                    index, text, None, logprobs, delta=True, tool_calls=pieces or None, reasoning=thought
                )
                yield sse(replies.chunk([choice]))
        elif isinstance(event, Finish):
            thought, answer = split.end(event.text) if split else ("", event.text)
            if thought and replies.shows_reasoning:
                yield sse(replies.chunk([replies.choice(index, "", None, None, delta=True, reasoning=thought)]))
            text, calls, reason = tools.end(reader, answer, event.reason)
            if calls and reader is not None and reader.streams:
                calls = reader.deltas()  # what of the calls has not streamed yet
            if text:
                yield sse(replies.chunk([replies.choice(index, text, None, None, delta=True)]))
            if calls:
                yield sse(replies.chunk([replies.choice(index, "", None, None, delta=True, tool_calls=calls)]))
            yield sse(replies.chunk([replies.choice(index, "", reason, None, delta=True)]))
        else:
            assert isinstance(event, Failure)
            # Headers are long sent: the error travels as the stream's last event.
            yield sse(failure_error(event).body())
            return
    if gen.include_usage:
        yield sse(replies.chunk([], _usage(seqs, splits)))
    yield b"data: [DONE]\n\n"


# The OpenAPI pieces of replies made of choices.

USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        **{k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "prompt_tokens_details": {
            "type": "object",
            "required": ["cached_tokens"],
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
        },
        "completion_tokens_details": {
            "type": "object",
            "properties": {
                k: {"type": "integer", "minimum": 0}
                for k in ("accepted_prediction_tokens", "rejected_prediction_tokens", "reasoning_tokens")
            },
        },
    },
}
CHOICE_BASE: Schema = {"index": {"type": "integer", "minimum": 0}, "finish_reason": {"enum": ["stop", "length"]}}


def envelope(model_id: str, kind: str, choice: Schema) -> Schema:
    """A whole reply of ``kind`` holding choices; its usage is the ``Usage`` component (``USAGE``)."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": kind},
            "created": {"type": "integer"},
            "model": {"enum": served_names(model_id)},
            "choices": {"type": "array", "minItems": 1, "items": choice},
            "usage": {"$ref": "#/components/schemas/Usage"},
        },
    }
