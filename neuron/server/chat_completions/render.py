"""A chat completion's reply: each choice a ``message`` (whole) or a ``delta`` (streamed), with a thinking
model's ``reasoning_content``, the tool calls and OpenAI's chat logprobs. The loops that build the reply from
the sequences are ``common.choices``. No MLX, no HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from neuron.engine.sequence import Chunk, Sequence
from neuron.server.common.choices import Said
from neuron.server.common.generation import Generation


class ChatShape:
    """A chat completion's side of ``choices.Replies`` (a ``choices.Shape``)."""

    def __init__(self, gen: Generation, token_text: Callable[[int], str]) -> None:
        self.gen = gen
        self.token_text = token_text

    def kind(self, chunk: bool) -> str:
        return "chat.completion.chunk" if chunk else "chat.completion"

    def logprobs(self, chunks: list[Chunk], index: int) -> dict[str, Any] | None:
        if not self.gen.logprobs:
            return None
        return {"content": [self._logprob(c) for c in chunks], "refusal": None}

    def _logprob(self, chunk: Chunk) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {**entry(chunk.token, chunk.logprob), "top_logprobs": [entry(t, lp) for t, lp in chunk.top]}

    def said(self, said: Said, delta: bool) -> dict[str, Any]:
        calls, reasoning = said.tool_calls, said.reasoning
        if delta:
            opening = said.going_on and not calls and not reasoning
            piece: dict[str, Any] = {"content": said.text} if said.text or opening else {}
            if reasoning:
                piece["reasoning_content"] = reasoning
            if calls:
                # A call read whole at the end is one delta; a call streamed as written (harmony's) comes in
                # pieces that carry their call's index, as OpenAI's do.
                piece["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            return {"delta": piece}
        message: dict[str, Any] = {
            "role": "assistant",
            "content": said.text or None if calls else said.text,
            "refusal": None,
        }
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {"message": message}

    def echo(self, seq: Sequence, index: int) -> tuple[str, dict[str, Any] | None]:
        return "", None  # chat never echoes the prompt

    def opening(self, index: int) -> dict[str, Any] | None:
        """Chat streams open each choice with the assistant's role and no text."""
        delta = {"role": "assistant", "content": ""}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
