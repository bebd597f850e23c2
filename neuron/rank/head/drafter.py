"""The draft model (``--draft-model``): whole on rank 0, it proposes each drafting row's next tokens.

Why whole, on rank 0: rank 0 samples, so the draft's tokens and distributions stay where the target's logits are
verified against them, and nothing new crosses a pipe (the tokens travel in the plan, as prompt lookup's do). A
draft is small by design: split over the ranks, each of its k sequential steps would pay the group's collectives,
which cost more than its weights take to read.

Each sequence has the draft's KV cache of its own, and the tokens it holds. Before drafting, the cache is cut back
to the longest beginning it shares with the row's context (a rejected draft's tail goes; mlx-lm's ``trim``), and
fed what it lacks: the prompt on a sequence's first draft, afterwards the step's token (and a draft's last token,
kept, that the draft never fed itself). Keeping in step by the tokens themselves needs nothing from the plan, so a
resumed or restored sequence, or one that did not draft for a while, is caught up the same way.

The k steps run batched over the rows: their caches merged (mlx-lm's ``BatchKVCache``, left-padded) and split back
after. Each token is drawn as the row's request samples: greedy, or from the distribution its temperature, top-p,
min-p and top-k leave (the penalties and logit biases are the target's alone); that distribution is ``q``, which
rejection sampling needs (``rank.head.rejection``).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k

from neuron.models.folder import read_config, text_config
from neuron.rank.failures import RankError
from neuron.rank.head.sampler import nucleus
from neuron.rank.model.share import load_share
from neuron.rank.runner import FORWARD_TOKENS
from neuron.step import DraftRow

MAX_BATCHED = 8  # tokens a row may lack and still be fed batched with the others, each lacking as many


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]
    q: mx.array | None  # (k, draft vocabulary): the distributions the tokens were drawn from; None when greedy


@dataclass(slots=True)
class _Held:
    cache: list[KVCache]
    tokens: list[int] = field(default_factory=list)  # what the cache holds
    key: mx.array | None = None


class Drafter:
    def __init__(self, model: nn.Module, vocab_size: int) -> None:
        self.held: dict[int, _Held] = {}  # by sequence; the head drops a sequence's as it leaves
        self.model = model
        self.vocab_size = vocab_size  # the target's: draft ids past it are never proposed

    @classmethod
    def load(cls, path: str, vocab_size: int) -> Drafter:
        """The draft model at ``path``, whole; refused where its caches cannot be cut back to a shorter length."""
        config = read_config(path)
        model = load_share(path, None)
        if not all(type(c) is KVCache for c in make_prompt_cache(model)):
            raise RankError(
                f"rank 0: the draft model {path} ({text_config(config).get('model_type')}) keeps a sliding window "
                "or a state, which cannot drop a rejected draft; pick a draft with plain attention"
            )
        return cls(model, vocab_size)

    def propose(self, rows: list[DraftRow]) -> dict[int, Proposal]:
        """``k`` tokens for each row, drawn by the draft model in one batched pass per token."""
        rows = [row for row in rows if row.k > 0 and row.context]
        if not rows:
            return {}
        held = [self._sync(row) for row in rows]
        missing = [row.context[len(h.tokens) :] for row, h in zip(rows, held, strict=True)]
        # Caught up one by one, to the last token, which goes batched: unless every row lacks the same few tokens
        # (a draft kept whole leaves its last token and the step's), and every cache holds some (merged, an empty
        # one has no shape to pad).
        if len({len(m) for m in missing}) > 1 or len(missing[0]) > MAX_BATCHED or not all(h.tokens for h in held):
            for h, m in zip(held, missing, strict=True):
                self._feed(h, m[:-1])
            missing = [m[-1:] for m in missing]
        cache: list[Any] = (
            held[0].cache
            if len(held) == 1
            else [BatchKVCache.merge(layers) for layers in zip(*(h.cache for h in held), strict=True)]
        )
        steps = max(row.k for row in rows)
        tokens, qs = [], []
        logits = self.model(mx.array(missing), cache=cache)[:, -1, :]
        for j in range(steps):
            drawn, q = draw(logits[:, : self.vocab_size], rows, held)
            tokens.append(drawn)
            qs.append(q)
            if j + 1 < steps:
                logits = self.model(drawn[:, None], cache=cache)[:, -1, :]
        drafted = mx.stack(tokens, axis=1)
        mx.eval(drafted, [q for q in qs if q is not None], [a for c in cache for a in (c.keys, c.values)])
        rows_drafted: list[list[int]] = drafted.tolist()  # type: ignore[assignment]
        out = {}
        for i, (row, h) in enumerate(zip(rows, held, strict=True)):
            if len(held) > 1:
                h.cache = [layer.extract(i) for layer in cache]
            h.tokens = row.context + rows_drafted[i][: steps - 1]  # the last drawn was never fed
            rows_q = [q[i] for q in qs[: row.k] if q is not None] if row.params.temperature > 0.0 else []
            out[row.seq] = Proposal(rows_drafted[i][: row.k], mx.stack(rows_q) if rows_q else None)
        return out

    def _sync(self, row: DraftRow) -> _Held:
        """The row's held cache, cut back to the longest beginning its tokens share with the context, leaving at
        least the context's last token to feed (its logits draw the first draft token)."""
        h = self.held.get(row.seq)
        if h is None:
            h = self.held[row.seq] = _Held(make_prompt_cache(self.model), [], new_key(row))
        same = min(len(h.tokens), len(row.context) - 1)
        if h.tokens[:same] != row.context[:same]:  # compared in C first: a rejected draft differs only at the end
            same = next(i for i, (a, b) in enumerate(zip(h.tokens, row.context, strict=False)) if a != b)
        if cut := len(h.tokens) - same:
            for layer in h.cache:
                layer.trim(cut)
            h.tokens = h.tokens[:same]
        return h

    def _feed(self, h: _Held, tokens: list[int]) -> None:
        for start in range(0, len(tokens), FORWARD_TOKENS):
            self.model(mx.array([tokens[start : start + FORWARD_TOKENS]]), cache=h.cache)
            mx.eval([a for c in h.cache for a in (c.keys, c.values)])
        h.tokens = h.tokens + tokens


class _Keyed(Protocol):
    key: mx.array | None


def draw(logits: mx.array, rows: list[DraftRow], held: Sequence[_Keyed]) -> tuple[mx.array, mx.array | None]:
    """Each row's next draft token from its ``logits`` (rows, vocabulary), and (where any row samples) each row's
    distribution it came from; a sampled row draws with its ``held`` key, which moves on."""
    logits = logits.astype(mx.float32)
    if all(row.params.temperature == 0.0 for row in rows):
        return mx.argmax(logits, axis=-1), None
    tokens, qs = [], []
    for i, (row, h) in enumerate(zip(rows, held, strict=True)):
        p = row.params
        if p.temperature == 0.0:
            tokens.append(mx.argmax(logits[i]))
            qs.append(mx.zeros((logits.shape[-1],)))
            continue
        filtered = logits[i : i + 1] - mx.logsumexp(logits[i : i + 1], axis=-1, keepdims=True)
        if p.top_p < 1.0:
            filtered = nucleus(filtered, p.top_p)
        if p.min_p > 0.0:
            filtered = apply_min_p(filtered, p.min_p)
        if 0 < p.top_k < filtered.shape[-1]:
            filtered = apply_top_k(filtered, p.top_k)
        weights = filtered[0] * (1.0 / p.temperature)
        assert h.key is not None
        h.key, key = mx.random.split(h.key)
        tokens.append(mx.random.categorical(weights, key=key))
        qs.append(mx.softmax(weights))
    return mx.stack(tokens), mx.stack(qs)


def new_key(row: DraftRow) -> mx.array:
    """A sequence's draft key: from its seed, where the request gave one, so that a seeded request repeats."""
    seed = row.params.seed
    return mx.random.key(seed ^ 0x5EED if seed is not None else secrets.randbits(63))
