"""Rank 0 turns logits into the next token; no other rank ever sees a logit.

Sampling on rank 0 alone is what keeps the pipes thin: the logits (a vocabulary
of floats per sequence per step) stay in rank 0's memory, and only the chosen
token id travels, inside the next step's request.

Each request gets its own random key, split once per token, so a seeded
request draws the same tokens whatever else the server is doing.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from neuron.sampling_params import PENALTY_WINDOW, SamplingParams

NOT_ASKED = float("nan")  # the logprob of a token whose request asked for none


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    # Of the chosen token, under the model's own distribution (before penalties and
    # temperature); NOT_ASKED unless the request asked for logprobs.
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens and their logprobs, when asked for


class Sampler:
    """One request's sampler: its parameters, its random key, and the recent tokens the penalties see."""

    def __init__(self, params: SamplingParams, prompt: list[int]) -> None:
        self.params = params
        self._seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._recent = prompt[-PENALTY_WINDOW:]
        # MLX state is made on first use: the engine builds a sampler on the event
        # loop's thread, but its arrays must belong to rank 0's thread, where it runs.
        self._key: mx.array | None = None
        self._processors: list[Callable[[mx.array, mx.array], mx.array]] = []

    @property
    def plain(self) -> bool:
        """Greedy with nothing else to compute: such rows can be sampled together (``sample_all``)."""
        p = self.params
        no_processing = not p.logit_bias and p.presence_penalty == p.frequency_penalty == 0.0
        return p.temperature == 0.0 and p.logprobs is None and no_processing and p.repetition_penalty == 1.0

    def record(self, sampled: Sampled) -> Sampled:
        self._recent = [*self._recent[1 - PENALTY_WINDOW :], sampled.token]
        return sampled

    def _start(self) -> mx.array:
        p = self.params
        self._processors = make_logits_processors(
            logit_bias=p.logit_bias or None,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
            repetition_context_size=PENALTY_WINDOW,
            presence_penalty=p.presence_penalty or None,
            presence_context_size=PENALTY_WINDOW,
            frequency_penalty=p.frequency_penalty or None,
            frequency_context_size=PENALTY_WINDOW,
        )
        return mx.random.key(self._seed)

    def __call__(self, logits: mx.array) -> Sampled:
        if self._key is None:
            self._key = self._start()
        p = self.params
        adjusted = logits[None]
        if self._processors:
            recent = mx.array(self._recent)
            for process in self._processors:
                adjusted = process(recent, adjusted)
        if p.temperature == 0.0:
            token = mx.argmax(adjusted[0])
        else:
            filtered = adjusted - mx.logsumexp(adjusted, axis=-1, keepdims=True)
            if p.top_p < 1.0:
                filtered = apply_top_p(filtered, p.top_p)
            if p.min_p > 0.0:
                filtered = apply_min_p(filtered, p.min_p)
            if 0 < p.top_k < filtered.shape[-1]:  # a k of the whole vocabulary or more keeps every token
                filtered = apply_top_k(filtered, p.top_k)
            self._key, draw = mx.random.split(self._key)
            token = mx.random.categorical(filtered[0] * (1.0 / p.temperature), key=draw)
        if p.logprobs is None:
            # No logprob asked for, none computed: a log-sum-exp over the vocabulary costs
            # about 1 ms per row on the CPU backend.
            return self.record(Sampled(int(token.item()), NOT_ASKED))
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        chosen = logprobs[token]
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs:
            ids = mx.argpartition(-logprobs, p.logprobs - 1)[: p.logprobs]
            mx.eval(token, chosen, ids, logprobs)
            ranked = sorted(zip(ids.tolist(), logprobs[ids].tolist(), strict=True), key=lambda x: -x[1])
            top = tuple((int(i), float(lp)) for i, lp in ranked)
        else:
            mx.eval(token, chosen)
        return self.record(Sampled(int(token.item()), float(chosen.item()), top))


def sample_all(samplers: dict[int, Sampler], logits: dict[int, mx.array]) -> dict[int, Sampled]:
    """Sample each sequence's logits with its own sampler; plain greedy rows share one argmax and one evaluation."""
    plain = [no for no in logits if samplers[no].plain]
    out: dict[int, Sampled] = {}
    if plain:
        tokens = mx.argmax(mx.stack([logits[no] for no in plain]), axis=-1).tolist()
        for no, token in zip(plain, tokens, strict=True):
            out[no] = samplers[no].record(Sampled(int(token), NOT_ASKED))
    for no, row in logits.items():
        if no not in out:
            out[no] = samplers[no](row)
    return out
