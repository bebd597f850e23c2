"""Speculative sampling against a draft model's distributions: rejection sampling as the literature defines it
(Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", 2023; Chen et al., "Accelerating
Large Language Model Decoding with Speculative Sampling", 2023).

The draft model drew each token ``d_i`` from its distribution ``q_i`` (``rank.head.drafter``); the target's step gives
``p_i`` at every position at once. ``d_i`` is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first
position that rejects, the token is drawn from ``norm(max(0, p_i - q_i))`` instead and the run ends; after a draft
kept whole, a bonus token is drawn from ``p_k``. Each token kept is then a draw from the target's distribution given
those before it, whatever ``q`` is, provided ``q_i`` is exactly the distribution ``d_i`` was drawn from.

``p_i`` is what the row's sampler would draw from there (``Sampler.weights``): its penalties, ``min_tokens``, its
filters and its temperature, as if the draft's tokens before it were kept (``Sampler.assume``). Greedy rows, and
rows asking for logprobs, keep the point-mass rule (``sampler.Run``), which is exact for them too.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import mlx.core as mx

from neuron.rank.head.sampler import Mark, Sampler
from neuron.step import NOT_ASKED, Sampled


@dataclasses.dataclass(slots=True)
class Rejection:
    """A drafted row's verdicts drawn but not yet read; ``keep`` decides the tokens kept, as ``sampler.Run``."""

    sampler: Sampler
    draft: list[int]
    accept: mx.array  # (k,) whether each draft token passes its test
    resampled: mx.array  # (k,) the token drawn from the residual at each position, used at the first rejection
    bonus: mx.array  # the token after a draft kept whole, drawn from p_k
    keys: list[mx.array | None]  # the sampler's key after each position
    before: Mark

    @staticmethod
    def applies(sampler: Sampler) -> bool:
        """Whether a row's drafted tokens are verified so: sampled rows that ask for no logprobs."""
        return sampler.params.temperature > 0.0 and sampler.params.logprobs is None

    @classmethod
    def draw(cls, sampler: Sampler, logits: mx.array, draft: list[int], q: mx.array) -> Rejection:
        """``logits``: the ``len(draft) + 1`` positions of a row fed ``[token] + draft``; ``q``: (len(draft),
        draft vocabulary) the distributions the draft's tokens were drawn from."""
        before = sampler.mark()
        weights = []
        for i in range(len(draft) + 1):
            weights.append(sampler.weights(logits[i]))
            if i < len(draft):
                sampler.assume(draft[i])
        sampler.rewind(before)
        p = mx.softmax(mx.stack(weights).astype(mx.float32), axis=-1)
        vocab = p.shape[-1]
        q = q[:, :vocab] if q.shape[-1] >= vocab else mx.pad(q, [(0, 0), (0, vocab - q.shape[-1])])
        keys, subs = [], []
        for _ in range(len(draft) + 1):  # one split per position, as plain decoding splits once per token
            subs.append(sampler.split())
            keys.append(sampler.mark().key)
        sampler.rewind(before)
        k = len(draft)
        chosen = mx.array(draft)[:, None]
        p_d = mx.take_along_axis(p[:k], chosen, axis=-1)[:, 0]
        q_d = mx.take_along_axis(q, chosen, axis=-1)[:, 0]
        halves = [mx.random.split(sub) for sub in subs[:k]]
        uniform = mx.stack([mx.random.uniform(key=half[0]) for half in halves])
        accept = uniform * q_d < p_d  # u < p / q, without dividing by a q that rounds to 0
        residual = mx.log(mx.maximum(p[:k] - q, 0.0))
        resampled = mx.stack([mx.random.categorical(residual[i], key=halves[i][1]) for i in range(k)])
        bonus = mx.random.categorical(mx.log(p[k]), key=subs[k])
        return cls(sampler, draft, accept, resampled, bonus, keys, before)

    def arrays(self) -> list[mx.array]:
        return [self.accept, self.resampled, self.bonus]

    def keep(self) -> Sampled:
        """Once read: the first token kept, the others in its ``more``."""
        accept = cast(list[bool], self.accept.tolist())
        resampled = cast(list[int], self.resampled.tolist())
        out = []
        for i, token in enumerate(self.draft):
            if not accept[i]:
                out.append(self.sampler.record(Sampled(resampled[i], NOT_ASKED)))
                break
            out.append(self.sampler.record(Sampled(token, NOT_ASKED)))
        else:
            out.append(self.sampler.record(Sampled(cast(int, self.bonus.item()), NOT_ASKED)))
        self.sampler.rewind(dataclasses.replace(self.sampler.mark(), key=self.keys[len(out) - 1]))
        return dataclasses.replace(out[0], more=tuple(out[1:]))
