"""Rank 0 turns logits into the next token; no other rank ever sees a logit.

Sampling on rank 0 alone is what keeps the pipes thin: the logits (a vocabulary
of floats per sequence per step) stay in rank 0's memory, and only the chosen
token id travels, inside the next step's request.

Each request gets its own random key, split once per token, so a seeded
request draws the same tokens whatever else the server is doing.

A sampler is made when a step starts its sequence (``Step.starts``), sees every
token fed to it (the penalties look at them), and is dropped when the plan says
the sequence leaves, as the ranks drop its KV cache: rank 0's ``Head`` holds
them (``rank.head.head``).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Mapping
from typing import Protocol, cast

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from neuron.rank.readback import floats, ints, scalar
from neuron.sampling_params import PENALTY_WINDOW, SamplingParams
from neuron.step import NOT_ASKED, Sampled


@dataclasses.dataclass(frozen=True, slots=True)
class Mark:
    key: mx.array | None
    recent: list[int]
    generated: int


# mlx-lm's apply_top_p drops each token whose mass above it reaches top_p times the whole, in float32: a top_p
# whose product rounds to zero there would drop every token, and the draw would fall on token 0 whatever the
# mask allowed. Any top_p under the top token's probability keeps that token alone, and so does this floor.
TOP_P_FLOOR = 1e-30


def nucleus(logprobs: mx.array, top_p: float) -> mx.array:
    """``logprobs`` with the tokens outside the ``top_p`` mass at -inf; the most likely token always kept."""
    return apply_top_p(logprobs, max(top_p, TOP_P_FLOOR))


class Sampler:
    """One request's sampler: its parameters, its random key, and the recent tokens the penalties see."""

    def __init__(self, params: SamplingParams, produced: tuple[int, ...] | None = None) -> None:
        """``produced``: the tokens this sequence sampled before a lost group (``Start.produced``); the sampler
        starts where it stood after them, as if it had never been lost."""
        self.params = params
        self._seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._recent: list[int] = []
        self._generated = len(produced or ())  # sampled so far: min_tokens holds the stop tokens back until enough
        self._prompt: list[tuple[float, tuple[tuple[int, float], ...]]] = []  # prompt scores not yet handed on
        self._tail: mx.array | None = None  # the last scored position's logprobs: they predict the next chunk
        self._key: mx.array | None = None  # made on first use
        self._processors: list[Callable[[mx.array, mx.array], mx.array]] = []
        if produced is not None and params.constraint is not None:
            params.constraint.rewind(list(produced))  # it may have followed a token of the step that failed

    @property
    def plain(self) -> bool:
        """Greedy with nothing else to compute: such rows are drawn together (``draw_all``)."""
        p = self.params
        no_processing = not p.logit_bias and p.presence_penalty == p.frequency_penalty == 0.0
        plain = p.temperature == 0.0 and p.logprobs is None and no_processing and p.repetition_penalty == 1.0
        return plain and not self._holding

    @property
    def _holding(self) -> bool:
        return self._generated < self.params.min_tokens and bool(self.params.stop_token_ids)

    def feed(self, tokens: list[int]) -> None:
        """Tokens fed to the sequence (its prompt): the penalties see the last PENALTY_WINDOW of them."""
        self._recent = [*self._recent, *tokens][-PENALTY_WINDOW:]

    def score(self, rows: mx.array, tokens: list[int]) -> None:
        """Score a prompt chunk: ``rows`` are its positions' logits; each predicts the token after it."""
        logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        if self._tail is None:  # the first chunk: nothing predicts the prompt's first token
            predicting, targets = logprobs[:-1], tokens[1:]
        else:
            predicting, targets = mx.concatenate([self._tail[None], logprobs[:-1]]), tokens
        self._tail = logprobs[-1]
        if not targets:
            return
        chosen = mx.take_along_axis(predicting, mx.array(targets)[:, None], axis=-1)[:, 0]
        k = self.params.prompt_logprobs or 0
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
        if k:
            ids = mx.argpartition(-predicting, k - 1, axis=-1)[:, :k]
            values = mx.take_along_axis(predicting, ids, axis=-1)
            mx.eval(chosen, ids, values)
            id_rows = cast(list[list[int]], ids.tolist())
            value_rows = cast(list[list[float]], values.tolist())
            tops = [
                tuple(sorted(zip(row_ids, row_values, strict=True), key=lambda x: -x[1]))
                for row_ids, row_values in zip(id_rows, value_rows, strict=True)
            ]
        self._prompt += list(zip(floats(chosen), tops, strict=True))

    def mark(self) -> Mark:
        """Where the sampler stands: its key and what the penalties and ``min_tokens`` see."""
        return Mark(self._key, list(self._recent), self._generated)

    def rewind(self, mark: Mark) -> None:
        self._key, self._recent, self._generated = mark.key, list(mark.recent), mark.generated

    def assume(self, token: int) -> None:
        """Draw the next position as if ``token`` had been sampled here (a draft's token, before it is verified)."""
        self.feed([token])
        self._generated += 1

    def record(self, sampled: Sampled) -> Sampled:
        self.feed([sampled.token])
        self._generated += 1
        if self._prompt:
            sampled = dataclasses.replace(sampled, prompt=tuple(self._prompt))
            self._prompt = []
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
        return rewound(self._seed, self._generated if p.temperature != 0.0 else 0)

    def __call__(self, logits: mx.array, allowed: mx.array | None = None) -> Sampled:
        """Sample from ``logits`` (one row), only among the ``allowed`` tokens when given."""
        return read({0: self.draw(logits, allowed)})[0]

    def draw(self, logits: mx.array, allowed: mx.array | None = None) -> Draw:
        """The token drawn from ``logits`` (one row), lazily: nothing is computed until ``read``."""
        p = self.params
        if p.temperature == 0.0:
            token = mx.argmax(self._adjusted(logits, allowed)[0])
        else:
            weights = self.weights(logits, allowed)
            token = mx.random.categorical(weights, key=self.split())
        if p.logprobs is None:
            # No logprob asked for, none computed: a log-sum-exp over the vocabulary is a pass over it per row.
            return Draw(self, token)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        top = mx.argpartition(-logprobs, p.logprobs - 1)[: p.logprobs] if p.logprobs else None
        return Draw(self, token, logprobs[token], top, None if top is None else logprobs[top])

    def weights(self, logits: mx.array, allowed: mx.array | None = None) -> mx.array:
        """The unnormalised log-probabilities a sampled row's token is drawn from (one row, temperature > 0):
        the penalties, the filters and the temperature applied, as ``draw`` draws. Speculation's rejection
        sampling (``rank.head.rejection``) needs the distribution itself, not only a draw from it."""
        p = self.params
        filtered = self._adjusted(logits, allowed)
        filtered = filtered - mx.logsumexp(filtered, axis=-1, keepdims=True)
        if p.top_p < 1.0:
            filtered = nucleus(filtered, p.top_p)
        if p.min_p > 0.0:
            filtered = apply_min_p(filtered, p.min_p)
        if 0 < p.top_k < filtered.shape[-1]:  # a k of the whole vocabulary or more keeps every token
            filtered = apply_top_k(filtered, p.top_k)
        return filtered[0] * (1.0 / p.temperature)

    def split(self) -> mx.array:
        """A key for one position's draw; the sampler's own key moves on (split once per position)."""
        if self._key is None:
            self._key = self._start()
        self._key, key = mx.random.split(self._key)
        return key

    def _adjusted(self, logits: mx.array, allowed: mx.array | None) -> mx.array:
        """``logits`` (one row) as (1, vocab), the penalties and the masks applied."""
        if self._key is None:
            self._key = self._start()
        p = self.params
        adjusted = logits[None]
        if self._processors:
            recent = mx.array(self._recent)
            for process in self._processors:
                adjusted = process(recent, adjusted)
        if self._holding:
            held = np.ones(adjusted.shape[-1], dtype=np.bool_)
            held[list(p.stop_token_ids)] = False
            allowed = mx.array(held) if allowed is None else allowed & mx.array(held)
        if allowed is not None:
            adjusted = _mask(adjusted, allowed)
        return adjusted


def rewound(seed: int, draws: int) -> mx.array:
    """The random key of a sampler seeded with ``seed`` after ``draws`` tokens: each draw splits it once
    (``Sampler.draw``), and keeps the first half."""
    key = mx.random.key(seed)
    for _ in range(draws):
        key = mx.random.split(key)[0]
    return key


@dataclasses.dataclass(slots=True)
class Draw:
    """A token drawn but not yet read: MLX arrays the device may still be computing. ``read`` brings a step's
    draws to the host at once, and records each token with its sampler."""

    sampler: Sampler
    token: mx.array
    chosen: mx.array | None = None  # its logprob, when asked for
    top: mx.array | None = None  # the most likely ids and their logprobs, when asked for
    top_logprobs: mx.array | None = None
    error: str | None = None  # the output constraint allowed no token: nothing was drawn

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.token, self.chosen, self.top, self.top_logprobs) if a is not None]


class Verdict(Protocol):
    """A drafted row's positions drawn but not yet read: its arrays evaluated with the step's draws, then ``keep``
    says the tokens it keeps (``Run``, and rejection sampling's ``rank.head.rejection.Rejection``)."""

    def arrays(self) -> list[mx.array]: ...

    def keep(self) -> Sampled: ...


def read(draws: dict[int, Draw], runs: Mapping[int, Verdict] | None = None) -> dict[int, Sampled]:
    """Each draw's token (and logprobs), and the tokens each drafted row keeps, on the host: the one place a step
    waits for the device."""
    runs = runs or {}
    mx.eval([d.arrays() for d in draws.values()], [r.arrays() for r in runs.values()])
    out = {no: run.keep() for no, run in runs.items()}
    for no, d in draws.items():
        if d.error is not None:
            out[no] = Sampled(0, NOT_ASKED, error=d.error)
            continue
        out[no] = d.sampler.record(_on_host(d))
    for no, d in draws.items():
        constraint = d.sampler.params.constraint
        if d.error is None and constraint is not None and (error := constraint.advance(out[no].token)) is not None:
            out[no] = Sampled(out[no].token, NOT_ASKED, error=error)
    return out


def _on_host(d: Draw) -> Sampled:
    """An evaluated draw's token and logprobs as host values."""
    token = int(scalar(d.token))
    if d.chosen is None:
        return Sampled(token, NOT_ASKED)
    top: tuple[tuple[int, float], ...] = ()
    if d.top is not None and d.top_logprobs is not None:
        top = tuple(sorted(zip(ints(d.top), floats(d.top_logprobs), strict=True), key=lambda x: -x[1]))
    return Sampled(token, scalar(d.chosen), top)


@dataclasses.dataclass(slots=True)
class Run:
    """A drafted row's positions drawn but not yet read (``Run.draw``): read with the step's other draws, then
    ``keep`` decides the tokens kept.

    Speculation's rule: keep the draft's tokens while each sampled token equals the draft's. A point-mass
    proposal, so this is exact rejection sampling (the token kept at each position is a draw from the target
    distribution given the tokens kept before it), and the key is split once per kept token, so a seeded request
    draws the same tokens with speculation on or off.

    Each position is drawn as plain decoding would draw it there, as if the
    draft's tokens before it were kept (the penalties and ``min_tokens`` see
    them, the key is split once per position); the run stops at the first token
    that differs from the draft (that token is kept: it is the sample at that
    position), or after the bonus token past a fully kept draft. The sampler is
    then set back to the run kept.
    """

    sampler: Sampler
    draft: list[int]
    draws: list[Draw]
    keys: list[mx.array | None]  # the sampler's key after each position's draw
    before: Mark

    @classmethod
    def draw(cls, sampler: Sampler, logits: mx.array, draft: list[int]) -> Run:
        """``logits`` holds the ``len(draft) + 1`` positions of a row fed ``[token] + draft``."""
        before = sampler.mark()
        if sampler.plain:  # greedy and nothing else: one argmax for every position, no state to follow
            return cls(sampler, draft, [Draw(sampler, mx.argmax(logits, axis=-1))], [], before)
        draws, keys = [], []
        for i in range(len(draft) + 1):
            draws.append(sampler.draw(logits[i]))
            keys.append(sampler.mark().key)
            if i < len(draft):
                sampler.assume(draft[i])
        sampler.rewind(before)
        return cls(sampler, draft, draws, keys, before)

    def arrays(self) -> list[mx.array]:
        return [a for d in self.draws for a in d.arrays()]

    def keep(self) -> Sampled:
        """Once read: the first token kept, the others in its ``more``."""
        sampled = (
            [Sampled(token, NOT_ASKED) for token in ints(self.draws[0].token)]
            if not self.keys
            else [_on_host(d) for d in self.draws]
        )
        out = []
        for i, one in enumerate(sampled):
            out.append(self.sampler.record(one))
            if i == len(self.draft) or one.token != self.draft[i]:
                break
        if self.keys:
            self.sampler.rewind(dataclasses.replace(self.sampler.mark(), key=self.keys[len(out) - 1]))
        return dataclasses.replace(out[0], more=tuple(out[1:]))


def sample_all(samplers: dict[int, Sampler], logits: dict[int, mx.array]) -> dict[int, Sampled]:
    """Each sequence's token from its logits, on the host."""
    return read(draw_all(samplers, logits))


def draw_all(samplers: dict[int, Sampler], logits: dict[int, mx.array]) -> dict[int, Draw]:
    """Draw each sequence's token with its own sampler, lazily; plain greedy rows share one argmax, and their masks
    one ``where`` (per row, it would cost more than the grammar's own work)."""
    allowed, out = _masks(samplers, logits)
    plain = [no for no in logits if samplers[no].plain and no not in out]
    if plain:
        stacked = mx.stack([logits[no] for no in plain])
        if any(no in allowed for no in plain):
            everything = np.ones(stacked.shape[-1], dtype=np.bool_)
            keep = np.stack([allowed.get(no, everything) for no in plain])
            stacked = mx.where(mx.array(keep), stacked, -mx.inf)
        tokens = mx.argmax(stacked, axis=-1)
        for i, no in enumerate(plain):
            out[no] = Draw(samplers[no], tokens[i])
    for no, row in logits.items():
        if no not in out:
            out[no] = samplers[no].draw(row, mx.array(allowed[no]) if no in allowed else None)
    return out


def _mask(logits: mx.array, allowed: mx.array) -> mx.array:
    """Only the allowed tokens keep a logit, and every one of them a finite one: the penalties can turn logits
    into NaN or -inf (a repetition penalty that rounds to 0 in float32), and no such value may let a refused
    token win, or leave nothing to draw."""
    return mx.where(allowed, mx.nan_to_num(logits), -mx.inf)


Masks = dict[int, np.ndarray]  # sequence -> which tokens it may sample next


def _masks(samplers: dict[int, Sampler], logits: dict[int, mx.array]) -> tuple[Masks, dict[int, Draw]]:
    """Each constrained row's allowed tokens, and the rows whose constraint allows none (they end in error)."""
    rows = [(no, c) for no in logits if (c := samplers[no].params.constraint) is not None]
    if not rows:
        return {}, {}
    width = next(iter(logits.values())).shape[-1]
    bits = np.zeros((len(rows), max(c.words for _, c in rows)), dtype=np.int32)
    failed = {}
    for i, (no, constraint) in enumerate(rows):
        if (error := constraint.fill(bits[i, : constraint.words])) is not None:
            failed[no] = Draw(samplers[no], mx.array(0), error=error)
    unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :width].astype(np.bool_)
    if unpacked.shape[1] < width:  # ids past the grammar's vocabulary are never allowed
        unpacked = np.pad(unpacked, ((0, 0), (0, width - unpacked.shape[1])))
    return {no: unpacked[i] for i, (no, _) in enumerate(rows) if no not in failed}, failed
