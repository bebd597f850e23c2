"""Two runs that must give the same greedy tokens (batched against alone, drafts on against off, a cancelled
neighbour against none, TP against TP=1), compared as the device that ran them allows.

The rule. On the CPU, exactly: every token and the text. On a GPU (CUDA, Metal), kernels for different batch
shapes reduce in different orders, so where two tokens' logits nearly tie the argmax may flip; there a difference
is accepted only at such a tie: at the first position where the runs differ, both tokens must be among the
reference run's top alternatives at that position, within ``NEAR_TIE`` of each other in log-probability (as vLLM's
``check_logprobs_close`` does). Past that position the runs may go apart, as any two texts after a different
token do. The tests' models have decisive logits (``conftest.make_tiny_model`` scales them up), so ties are rare
and the exact comparison is the one that runs almost always.

The runs are read with their logprobs (a completions request with ``logprobs: TOP``, or a chat one with
``logprobs: true, top_logprobs: TOP``); the reference is the run without the thing under test (alone, no drafts,
no cancelled neighbour).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from neuron.system import device

TOP = 5  # alternatives asked for at each position
NEAR_TIE = 0.05  # nats: a flip between tokens further apart than this is a bug, not arithmetic


@dataclass(frozen=True, slots=True)
class Scored:
    """One choice's text, its tokens, and at each position the top alternatives' log-probabilities."""

    text: str
    tokens: list[str] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def of(cls, choice: Mapping[str, Any], *, streamed: bool = False) -> Scored:
        """From an OpenAI completions or chat choice (a JSON object, or the client's ``choice.model_dump()``), or
        one chunk's choice of a stream (``streamed``: its last chunks carry text held back, or nothing, unscored)."""
        message = choice.get("message") or choice.get("delta") or {}
        text = choice["text"] if "text" in choice else message.get("content")
        logprobs = choice.get("logprobs")
        if logprobs is None and streamed:
            return cls(text or "")
        assert logprobs, "ask for logprobs (closeness.TOP of them): near ties are judged by them"
        if "content" in logprobs:  # chat: one entry per token, each with its alternatives
            entries = logprobs["content"] or []
            tokens = [e["token"] for e in entries]
            top = [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]
            return cls(text or "", tokens, top)
        return cls(text or "", list(logprobs["tokens"]), [dict(t or {}) for t in logprobs["top_logprobs"]])

    @classmethod
    def joined(cls, pieces: Iterable[Scored]) -> Scored:
        """A streamed choice, from its chunks in order."""
        text, tokens, top = "", [], []
        for piece in pieces:
            text += piece.text
            tokens += piece.tokens
            top += piece.top
        return cls(text, tokens, top)

    def head(self, count: int) -> Scored:
        """The first ``count`` tokens, without the text (a stream cut short may not have sent all of theirs)."""
        return Scored("", self.tokens[:count], self.top[:count])


def exact() -> bool:
    """Whether this device must reproduce tokens exactly (the CPU), rather than up to near ties."""
    return device.backend() == "cpu"


def difference(reference: Scored, other: Scored, margin: float = NEAR_TIE) -> str | None:
    """Why ``other`` is not ``reference`` up to a near tie; None when it is."""
    for i, (want, got) in enumerate(zip(reference.tokens, other.tokens, strict=False)):
        if want == got:
            continue
        alternatives = reference.top[i]
        if want not in alternatives or got not in alternatives:
            return f"token {i}: {got!r} for {want!r}, not both among the reference's top {alternatives}"
        gap = abs(alternatives[want] - alternatives[got])
        if gap > margin:
            return f"token {i}: {got!r} for {want!r}, {gap:.3f} apart in log-probability (a near tie is {margin})"
        return None  # a near tie flipped: what follows it may differ
    if len(reference.tokens) != len(other.tokens):
        return f"the same first tokens, but {len(other.tokens)} of them against the reference's {len(reference.tokens)}"
    if reference.text != other.text:
        return f"the same tokens, but the text {other.text!r} against the reference's {reference.text!r}"
    return None


def assert_same(reference: Scored, other: Scored, what: str = "") -> None:
    """``other`` gives ``reference``'s tokens: exactly on the CPU, up to a near tie on a GPU (the module's rule)."""
    where = f"{what}: " if what else ""
    if exact():
        assert (other.tokens, other.text) == (reference.tokens, reference.text), (
            f"{where}{other.text!r} != {reference.text!r}"
        )
        return
    problem = difference(reference, other)
    assert problem is None, where + problem


def assert_all_same(references: list[Scored], others: list[Scored], what: str = "") -> None:
    assert len(others) == len(references), f"{what}: {len(others)} runs against {len(references)}"
    for i, (reference, other) in enumerate(zip(references, others, strict=True)):
        assert_same(reference, other, f"{what} {i}".strip())
