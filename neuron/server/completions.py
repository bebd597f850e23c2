"""Replies of the chat and completions routes, one choice per sequence: whole, or streamed as chunks that carry
each choice's ``index``. No MLX, no HTTP.

A request's choices are its prompts times ``n``, indexed as OpenAI does (prompt i's choice j is i * n + j);
they decode together in the batch, so their events interleave step by step.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import anyio
import orjson

from neuron.engine.sequence import Chunk, Event, Failure, Finish, Sequence
from neuron.server import tools
from neuron.server.openai_api import ApiError, Generation, failure_error
from neuron.server.reasoning import ReasoningSplit
from neuron.server.tools import ToolStream


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


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Replies:
    """Builds one request's reply objects, in the chat or the completions shape."""

    def __init__(
        self,
        gen: Generation,
        request_id: str,
        token_text: Callable[[int], str],
        decode: Callable[[list[int]], str] = lambda tokens: "",
    ) -> None:
        self.gen = gen
        self.id = request_id
        self.created = int(time.time())
        self.token_text = token_text
        self.decode = decode
        self._offsets: dict[int, int] = {}  # completions' text_offset, per choice
        self.shows_reasoning = gen.reasoning is None or gen.reasoning.include  # vLLM's include_reasoning

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.gen.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.gen.model}

    def logprobs(self, chunks: list[Chunk], index: int = 0) -> dict[str, Any] | None:
        if not self.gen.logprobs:
            return None
        if self.gen.chat:
            return {"content": [self._chat_logprob(c) for c in chunks], "refusal": None}
        return self._completion_logprobs(
            index, [c.token for c in chunks], [c.logprob for c in chunks], [self._top(c.top) for c in chunks]
        )

    def _top(self, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
        return {self.token_text(t): lp for t, lp in top}

    def _completion_logprobs(
        self, index: int, ids: list[int], logprobs: list[float | None], tops: list[dict[str, float] | None]
    ) -> dict[str, Any]:
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(token)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def echo(self, seq: Sequence, index: int) -> tuple[str, dict[str, Any] | None]:
        """The prompt's text and, with logprobs, its scores: the first token's null, as nothing predicts it."""
        if not self.gen.echo:
            return "", None
        if not self.gen.logprobs:
            return self.decode(seq.prompt), None
        scores = (seq.copy_of or seq).prompt_logprobs  # the copies' prompt is their original's
        logprobs = [None, *(lp for lp, _ in scores)]
        tops = [None, *(self._top(top) for _, top in scores)]
        return self.decode(seq.prompt), self._completion_logprobs(index, seq.prompt, logprobs, tops)

    def _chat_logprob(self, chunk: Chunk) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {**entry(chunk.token, chunk.logprob), "top_logprobs": [entry(t, lp) for t, lp in chunk.top]}

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
    ) -> dict:
        """One choice; ``reasoning`` (a thinking model's, unless the request left it out) as vLLM's
        ``reasoning_content``."""
        out: dict[str, Any] = {"index": index}
        if not self.gen.chat:
            out["text"] = text
        elif delta:
            opening = finish_reason is None and not tool_calls and not reasoning
            out["delta"] = {"content": text} if text or opening else {}
            if reasoning:
                out["delta"]["reasoning_content"] = reasoning
            if tool_calls:
                # One delta per call, each whole: a client's accumulation of argument pieces reads it the same.
                out["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        else:
            out["message"] = {"role": "assistant", "content": text or None if tool_calls else text, "refusal": None}
            if reasoning is not None:
                out["message"]["reasoning_content"] = reasoning
            if tool_calls:
                out["message"]["tool_calls"] = tool_calls
        out["logprobs"] = logprobs
        out["finish_reason"] = finish_reason
        return out

    def chunk(self, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {**self._envelope(chunk=True), "choices": choices}
        if self.gen.include_usage:
            out["usage"] = usage_
        return out

    def opening(self, index: int) -> dict[str, Any] | None:
        """Chat streams open each choice with the assistant's role and no text."""
        if not self.gen.chat:
            return None
        delta = {"role": "assistant", "content": ""}
        return self.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])

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


def _joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
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
                prompt, scores = replies.echo(seq, index)
                logprobs = _joined(scores, replies.logprobs(chunks, index))
                shown = (thought or None) if replies.shows_reasoning else None
                choice = replies.choice(
                    index, prompt + text, reason, logprobs, delta=False, tool_calls=calls, reasoning=shown
                )
                choices.append(choice)
                break
            else:
                raise failure_error(event)
        else:
            raise ApiError(500, "the engine ended the request without an answer", type="server_error")
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
        if opening := replies.opening(index):
            yield sse(opening)
    echoed: set[int] = set()
    async for index, event in merged(seqs):
        reader = readers[index]
        if gen.echo and index not in echoed:
            echoed.add(index)
            prompt, scores = replies.echo(seqs[index], index)
            yield sse(replies.chunk([replies.choice(index, prompt, None, scores, delta=True)]))
        split = splits[index]
        if isinstance(event, Chunk):
            thought, answer = split.push(event.text) if split else ("", event.text)
            thought = thought if replies.shows_reasoning else ""
            text = reader.push(answer) if reader else answer
            if text or thought or gen.logprobs:
                logprobs = replies.logprobs([event], index)
                yield sse(replies.chunk([replies.choice(index, text, None, logprobs, delta=True, reasoning=thought)]))
        elif isinstance(event, Finish):
            thought, answer = split.end(event.text) if split else ("", event.text)
            if thought and replies.shows_reasoning:
                yield sse(replies.chunk([replies.choice(index, "", None, None, delta=True, reasoning=thought)]))
            text, calls, reason = tools.end(reader, answer, event.reason)
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
