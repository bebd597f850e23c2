"""A text completion's reply: each choice's ``text`` (after the prompt, with ``echo``) and OpenAI's completions
logprobs, offsets counted per choice. The loops that build the reply from the sequences are ``common.choices``.
No MLX, no HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from neuron.engine.sequence import Chunk, Sequence
from neuron.server.common.choices import Said
from neuron.server.common.generation import Generation


class CompletionShape:
    """A text completion's side of ``choices.Replies`` (a ``choices.Shape``)."""

    def __init__(self, gen: Generation, token_text: Callable[[int], str], decode: Callable[[list[int]], str]) -> None:
        self.gen = gen
        self.token_text = token_text
        self.decode = decode
        self._offsets: dict[int, int] = {}  # text_offset, per choice

    def kind(self, chunk: bool) -> str:
        return "text_completion"

    def logprobs(self, chunks: list[Chunk], index: int) -> dict[str, Any] | None:
        if not self.gen.logprobs:
            return None
        return self._logprobs(
            index, [c.token for c in chunks], [c.logprob for c in chunks], [self._top(c.top) for c in chunks]
        )

    def _top(self, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
        return {self.token_text(t): lp for t, lp in top}

    def _logprobs(
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
        return self.decode(seq.prompt), self._logprobs(index, seq.prompt, logprobs, tops)

    def said(self, said: Said, delta: bool) -> dict[str, Any]:
        return {"text": said.text}

    def opening(self, index: int) -> dict[str, Any] | None:
        return None  # a completion's stream opens with its first text
