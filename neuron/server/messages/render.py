"""The Messages API's reply: a Message (thinking, text and tool_use blocks) whole, or Anthropic's stream of
events; errors in Anthropic's shape. A stop sequence is cut off the text here and named (``stop_sequence``); the
stream holds one token's text back for that. No MLX, no HTTP.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from neuron.engine.sequence import Chunk, Finish, Sequence
from neuron.server.common.errors import ApiError, failure_error, no_answer
from neuron.server.common.generation import Generation
from neuron.server.common.reasoning import ReasoningSplit
from neuron.server.common.tools import ToolStream, end

STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error shape; the field, when one is at fault, is named in the message."""
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


@dataclass(slots=True)
class Outcome:
    """What a finished reply says beyond its blocks."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str = "end_turn"
    stop_sequence: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)


def usage(finish: Finish | None, seq: Sequence) -> dict[str, Any]:
    """Anthropic counts the prompt tokens read from its cache apart from ``input_tokens``."""
    cached = finish.cached_tokens if finish else seq.cached
    return {
        "input_tokens": len(seq.prompt) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": finish.completion_tokens if finish else 0,
    }


async def pieces(
    seq: Sequence, gen: Generation, split: ReasoningSplit | None, reader: ToolStream | None
) -> AsyncIterator[tuple[str, Any] | Outcome]:
    """The reply as it comes: ("thinking", text) and ("text", text) pieces, ("call", piece) for a call that
    streams as it is written (``ToolStream.deltas``), then its ``Outcome``."""
    stops = sorted(gen.params.stop, key=len, reverse=True)
    held = ""  # the last token's text, which may end with the stop sequence that ended the reply

    def parts(text: str, last: bool) -> list[tuple[str, Any]]:
        thought, answer = (split.end(text) if last else split.push(text)) if split else ("", text)
        if reader is None:
            return [("thinking", thought), ("text", answer)]
        answer = reader.push(answer)
        return [("thinking", thought), ("text", answer), *(("call", piece) for piece in reader.deltas())]

    async for event in seq.events:
        if isinstance(event, Chunk):
            for part in parts(held, last=False) if held else ():
                yield part
            held = event.text
        elif isinstance(event, Finish):
            text, stopped_by = held + event.text, None
            if event.reason == "stop" and stops:
                stopped_by = next((s for s in stops if text.endswith(s)), None)
                text = text[: len(text) - len(stopped_by)] if stopped_by else text
            for part in parts(text, last=True):
                yield part
            tail, calls, reason = end(reader, "", event.reason)
            if tail:
                yield ("text", tail)
            stop_reason = {"length": "max_tokens"}.get(reason, "end_turn")
            if calls and reason != "length":  # a call cut short by max_tokens is still a tool_use block
                stop_reason = "tool_use"
            elif stopped_by is not None:
                stop_reason = "stop_sequence"
            yield Outcome(calls or [], stop_reason, stopped_by, usage(event, seq))
            return
        else:
            raise failure_error(event)
    raise no_answer()


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    call_id = "toolu_" + call["id"].removeprefix("call_")
    return {
        "type": "tool_use",
        "id": call_id,
        "name": call["function"]["name"],
        "input": _input(call["function"]["arguments"]),
    }


def _input(arguments: str) -> Any:
    """A call's arguments as ``input``; those cut short by max_tokens, unfinished JSON, as far as an object can
    hold them: none."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def message(request_id: str, model: str, content: list[dict[str, Any]], outcome: Outcome | None) -> dict[str, Any]:
    return {
        "id": request_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": outcome.stop_reason if outcome else None,
        "stop_sequence": outcome.stop_sequence if outcome else None,
        "usage": outcome.usage if outcome else {},
    }


async def collect(
    seq: Sequence, gen: Generation, request_id: str, split: ReasoningSplit | None, reader: ToolStream | None
) -> dict[str, Any]:
    thought: list[str] = []
    text: list[str] = []
    outcome = Outcome()
    async for piece in pieces(seq, gen, split, reader):
        if isinstance(piece, Outcome):
            outcome = piece
        elif piece[0] != "call":  # a whole reply takes its calls from the outcome
            (thought if piece[0] == "thinking" else text).append(piece[1])
    content: list[dict[str, Any]] = []
    if split is not None and "".join(thought):
        content.append({"type": "thinking", "thinking": "".join(thought), "signature": ""})
    if "".join(text) or not (outcome.calls or content):
        content.append({"type": "text", "text": "".join(text)})
    content += [tool_use(call) for call in outcome.calls]
    return message(request_id, gen.model, content, outcome)


def sse(event: dict[str, Any]) -> bytes:
    """Each event named on an ``event:`` line too, as Anthropic's stream does."""
    return f"event: {event['type']}\ndata: ".encode() + orjson.dumps(event) + b"\n\n"


async def events(
    seq: Sequence, gen: Generation, request_id: str, split: ReasoningSplit | None, reader: ToolStream | None
) -> AsyncGenerator[bytes]:
    """Anthropic's event order: message_start; per block content_block_start, its deltas, content_block_stop
    (thinking, then text, then each tool_use); message_delta with stop_reason and usage; message_stop."""
    yield sse(
        {"type": "message_start", "message": message(request_id, gen.model, [], None) | {"usage": usage(None, seq)}}
    )
    index, open_kind = -1, None

    def start(kind: str) -> bytes:
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        return sse({"type": "content_block_start", "index": index, "content_block": block})

    def stop() -> list[bytes]:
        closing = (
            [
                sse(
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "signature_delta", "signature": ""},
                    }
                )
            ]
            if open_kind == "thinking"
            else []
        )
        return [*closing, sse({"type": "content_block_stop", "index": index})]

    outcome = Outcome()
    streamed = 0  # the calls whose tool_use blocks opened as they were written
    try:
        async for piece in pieces(seq, gen, split, reader):
            if isinstance(piece, Outcome):
                outcome = piece
                break
            kind, text = piece
            if kind == "call":
                if "id" in text:  # a call begins: its block opens, named, as Anthropic's does
                    if open_kind is not None:
                        for data in stop():
                            yield data
                    index, open_kind, streamed = index + 1, "call", streamed + 1
                    block = {**tool_use(text), "input": {}}
                    yield sse({"type": "content_block_start", "index": index, "content_block": block})
                if arguments := text["function"]["arguments"]:
                    delta = {"type": "input_json_delta", "partial_json": arguments}
                    yield sse({"type": "content_block_delta", "index": index, "delta": delta})
                continue
            if not text:
                continue
            if kind != open_kind:
                if open_kind is not None:
                    for data in stop():
                        yield data
                index, open_kind = index + 1, kind
                yield start(kind)
            delta = (
                {"type": "thinking_delta", "thinking": text}
                if kind == "thinking"
                else {"type": "text_delta", "text": text}
            )
            yield sse({"type": "content_block_delta", "index": index, "delta": delta})
    except ApiError as error:
        # Headers are long sent: the error travels as an `error` event, and the stream ends there.
        yield sse(error_body(error))
        return
    if open_kind is None and not outcome.calls:
        index, open_kind = 0, "text"
        yield start("text")
    if open_kind is not None:
        for data in stop():
            yield data
    for call in outcome.calls[streamed:]:
        index += 1
        block = tool_use(call)
        yield sse({"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}})
        delta = {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
        yield sse({"type": "content_block_delta", "index": index, "delta": delta})
        yield sse({"type": "content_block_stop", "index": index})
    end_delta = {"stop_reason": outcome.stop_reason, "stop_sequence": outcome.stop_sequence}
    yield sse({"type": "message_delta", "delta": end_delta, "usage": outcome.usage})
    yield sse({"type": "message_stop"})
