"""Rank 0 turns logits into the next token; no other rank ever sees a logit.

Sampling on rank 0 alone is what keeps the pipes thin: the logits (a vocabulary
of floats per sequence per step) stay in rank 0's memory, and only the chosen
token id travels, inside the next step's request.

Each request gets its own random key, split once per token, so a seeded
request draws the same tokens whatever else the server is doing.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    min_p: float = 0.0
    seed: int | None = None

    def problems(self) -> list[str]:
        """What is wrong with these parameters, as messages naming each field."""
        out = []
        if not 0.0 <= self.temperature <= 100.0:
            out.append(f"temperature must lie in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            out.append(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            out.append(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            out.append(f"min_p must lie in [0, 1), got {self.min_p}")
        return out


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    logprob: float


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)

    def __call__(self, logits: mx.array) -> Sampled:
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        p = self.params
        if p.temperature == 0.0:
            token = mx.argmax(logprobs)
        else:
            filtered = logprobs[None]
            if p.top_p < 1.0:
                filtered = apply_top_p(filtered, p.top_p)
            if p.min_p > 0.0:
                filtered = apply_min_p(filtered, p.min_p)
            if p.top_k > 0:
                filtered = apply_top_k(filtered, p.top_k)
            self._key, draw = mx.random.split(self._key)
            token = mx.random.categorical(filtered[0] * (1.0 / p.temperature), key=draw)
        chosen = logprobs[token]
        mx.eval(token, chosen)
        return Sampled(int(token.item()), float(chosen.item()))
