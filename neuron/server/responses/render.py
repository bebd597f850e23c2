"""The Responses API's reply: a Response object (reasoning, message and function call items) whole, or its
stream of typed events. No MLX, no HTTP.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from neuron.engine.sequence import Chunk, Finish, Sequence
from neuron.server.common.errors import failure_error, no_answer
from neuron.server.common.generation import Generation
from neuron.server.common.reasoning import ReasoningSplit
from neuron.server.common.tools import ToolStream, end


class ResponseReplies:
    """One request's Response object and stream events."""

    def __init__(
        self, gen: Generation, body: dict[str, Any], request_id: str, split: ReasoningSplit | None = None
    ) -> None:
        self.gen = gen
        self.body = body
        self.id = request_id
        self.created = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.split = split  # a thinking model's: its reasoning becomes a `reasoning` item before the message
        self.message_index = 0  # the message's place in `output`: 1 after a reasoning item
        self._sequence = 0

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, reason: str | None = None
    ) -> dict[str, Any]:
        body = self.body
        tools = [t for t in body.get("tools") or []]
        incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.gen.model,
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
            "tools": tools,
            "text": body.get("text") or {"format": {"type": "text"}},
            "store": False,
            "metadata": body.get("metadata") or {},
            "usage": usage,
        }

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [self.part(text)] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def calls(tool_calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        return [
            {
                "type": "function_call",
                "id": f"fc_{call['id'].removeprefix('call_')}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
            for call in tool_calls or []
        ]

    def reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content, "status": status}

    def output(self, text: str, tool_calls: list[dict[str, Any]] | None, thought: str = "") -> list[dict[str, Any]]:
        """The reasoning (if any), a message with the text (unless only calls came back), then each call."""
        reasoning = [self.reasoning(thought)] if thought else []
        return reasoning + ([self.message(text)] if text or not tool_calls else []) + self.calls(tool_calls)

    def split_text(self, text: str, last: bool = False) -> tuple[str, str]:
        """(reasoning, answer) of one token's text, or of the last text."""
        if self.split is None:
            return "", text
        return self.split.end(text) if last else self.split.push(text)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def text_item(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event about the message's one text part."""
        return self.event(kind, item_id=self.message_id, output_index=self.message_index, content_index=0, **fields)

    def reasoning_item(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event about the reasoning item's one text part."""
        return self.event(kind, item_id=self.reasoning_id, output_index=0, content_index=0, **fields)


def usage(finish: Finish, reasoning_tokens: int = 0) -> dict[str, Any]:
    prompt_tokens, completion_tokens = finish.prompt_tokens, finish.completion_tokens
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": finish.cached_tokens,
            "cache_write_tokens": finish.cache_write_tokens,
        },
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(event: dict[str, Any]) -> bytes:
    """The Responses stream names each event's type on an ``event:`` line too, as OpenAI's does."""
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event).encode() + b"\n\n"


async def collect(seq: Sequence, replies: ResponseReplies, reader: ToolStream | None) -> dict[str, Any]:
    texts = []
    async for event in seq.events:
        if isinstance(event, Chunk):
            texts.append(event.text)
        elif isinstance(event, Finish):
            split = replies.split
            thought, answer = split.whole(texts, event.text) if split else ("", "".join(texts) + event.text)
            text, calls, reason = end(reader, answer, event.reason)
            counts = usage(event, split.tokens if split else 0)
            return replies.response("completed", replies.output(text, calls, thought), counts, reason)
        else:
            raise failure_error(event)
    raise no_answer()


async def events(seq: Sequence, replies: ResponseReplies, reader: ToolStream | None) -> AsyncGenerator[bytes]:
    """OpenAI's event order: created, in_progress, the message's item and part opened, text deltas, each closed,
    then the function calls (each opened as it begins where the reader streams them, gpt-oss's, its arguments in
    deltas as written; else whole at the end), then completed (or incomplete) with the whole response."""
    started = replies.response("in_progress", [], None)
    yield sse(replies.event("response.created", response=started))
    yield sse(replies.event("response.in_progress", response=started))
    opened = closed = False  # the message item
    texts: list[str] = []
    streamed: list[tuple[int, str]] = []  # the output index and item id of each call opened as it was written
    thoughts: list[str] = []  # the reasoning item's text, while it is open (until the answer begins)

    def open_message() -> Iterator[bytes]:
        item = replies.message("", "in_progress")
        yield sse(replies.event("response.output_item.added", output_index=replies.message_index, item=item))
        yield sse(replies.text_item("response.content_part.added", part=replies.part("")))

    def close_reasoning() -> Iterator[bytes]:
        thought = "".join(thoughts)
        yield sse(replies.reasoning_item("response.reasoning_text.done", text=thought))
        yield sse(replies.event("response.output_item.done", output_index=0, item=replies.reasoning(thought)))
        replies.message_index = 1

    def close_message() -> Iterator[bytes]:
        whole = "".join(texts)
        yield sse(replies.text_item("response.output_text.done", text=whole, logprobs=[]))
        yield sse(replies.text_item("response.content_part.done", part=replies.part(whole)))
        item = replies.message(whole)
        yield sse(replies.event("response.output_item.done", output_index=replies.message_index, item=item))

    def call_pieces(pieces: list[dict[str, Any]]) -> Iterator[bytes]:
        nonlocal closed
        for piece in pieces:
            if "id" in piece:  # a call begins: the message before it is done
                if opened and not closed:
                    closed = True
                    yield from close_message()
                item = {**replies.calls([piece])[0], "arguments": "", "status": "in_progress"}
                streamed.append((replies.message_index + opened + len(streamed), item["id"]))
                yield sse(replies.event("response.output_item.added", output_index=streamed[-1][0], item=item))
            if arguments := piece["function"]["arguments"]:
                index, item_id = streamed[piece["index"]]
                where = {"item_id": item_id, "output_index": index}
                yield sse(replies.event("response.function_call_arguments.delta", **where, delta=arguments))

    async for event in seq.events:
        pieces: list[dict[str, Any]] = []
        if isinstance(event, Chunk):
            thought, answer = replies.split_text(event.text)
            text = reader.push(answer) if reader else answer
            pieces = reader.deltas() if reader else []
        elif isinstance(event, Finish):
            thought, answer = replies.split_text(event.text, last=True)
            text, calls, reason = end(reader, answer, event.reason)
            pieces = reader.deltas() if reader else []
        else:
            error = failure_error(event)
            yield sse(replies.event("error", code=error.code, message=error.message, param=None))
            return
        if thought and not opened:
            # Reasoning after the answer began (a model opening a second section) stays out of the stream.
            if not thoughts:
                item = replies.reasoning("", "in_progress")
                yield sse(replies.event("response.output_item.added", output_index=0, item=item))
            thoughts.append(thought)
            yield sse(replies.reasoning_item("response.reasoning_text.delta", delta=thought))
        if (text or pieces or isinstance(event, Finish)) and thoughts and replies.message_index == 0:
            for data in close_reasoning():
                yield data
        if text and not closed:
            if not opened:
                opened = True
                for data in open_message():
                    yield data
            texts.append(text)
            yield sse(replies.text_item("response.output_text.delta", delta=text, logprobs=[]))
        for data in call_pieces(pieces):
            yield data
        if isinstance(event, Finish):
            break
    else:
        message = "the engine ended the request without an answer"
        yield sse(replies.event("error", code="server_error", message=message, param=None))
        return
    whole = "".join(texts)
    if (opened or not calls) and not closed:
        if not opened:
            for data in open_message():
                yield data
        for data in close_message():
            yield data
    output = replies.output(whole, calls, "".join(thoughts))
    first_call = len(output) - len(calls or [])
    for index, item in enumerate(output[first_call:], first_call):
        where = {"item_id": item["id"], "output_index": index}
        if (index, item["id"]) not in streamed:
            added = {**item, "arguments": "", "status": "in_progress"}
            yield sse(replies.event("response.output_item.added", output_index=index, item=added))
            yield sse(replies.event("response.function_call_arguments.delta", **where, delta=item["arguments"]))
        yield sse(replies.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        yield sse(replies.event("response.output_item.done", output_index=index, item=item))
    final = replies.response("completed", output, usage(event, replies.split.tokens if replies.split else 0), reason)
    yield sse(replies.event(f"response.{final['status']}", response=final))
