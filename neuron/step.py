"""A step: everything the scheduler decided for one batched step, the one contract the pool and every rank read,
and what rank 0 answers for each of its sequences (``Sampled``).

``Step.plan`` is what every rank runs (it travels to the workers as
``rpc.GenerateStep``); ``Step.starts`` is what only rank 0's sampler reads:
the sampling parameters of each sequence the step starts, and the tokens its
penalties must see that the step does not feed (a restored prefix's tail).
Grammars live in those parameters, which is why they never cross a pipe; and
``Step.images`` is what only rank 0's image encoder reads.

Nothing reaches a rank from beside the step: the engine passes the ``Step``
whole, rank 0's ``Head`` follows it and refuses a sequence it does not
know, and no rank works anything out again from the scheduler's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neuron.images import Inputs
from neuron.rpc import StepPlan
from neuron.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Start:
    """A sequence this step starts, as rank 0's sampler needs it."""

    params: SamplingParams
    # Tokens already in its cache that no chunk of this step feeds (the tail of a restored prefix, or the prompt a
    # copy shares with its original): the penalties look at them.
    recent: tuple[int, ...] = ()
    # Set when it resumes after a lost group: the tokens it had sampled before (its prompt's chunks feed them
    # again). Its sampler starts where it stood after them: the random key split once per token, min_tokens
    # counting them, the output constraint advanced over them. None: a sequence starting afresh.
    produced: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Step:
    plan: StepPlan  # the same for every rank: it fixes every tensor shape and collective
    starts: dict[int, Start] = field(default_factory=dict)  # rank 0 only: sequence number -> how it is sampled
    # The leader only: each entry the plan spills to disk (``Evict.key``) -> its tokens, for the leader's manifest.
    spilled: dict[str, list[int]] = field(default_factory=dict)
    budget: int = 0  # the leader only: the prompt tokens the scheduler let this step feed (``prefill_budget``)
    # Rank 0 only: the pixel inputs of the images whose features the plan's prompt chunks put in, by digest (rank 0
    # encodes them; it runs in the leader, so they never cross a pipe).
    images: dict[str, Inputs] = field(default_factory=dict)


NOT_ASKED = float("nan")  # the logprob of a token whose request asked for none


@dataclass(frozen=True, slots=True)
class Sampled:
    """What rank 0 sampled for one sequence in one step (for an embedding input, its vector)."""

    token: int
    # Of the chosen token, under the model's own distribution (before penalties and
    # temperature); NOT_ASKED unless the request asked for logprobs.
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens and their logprobs, when asked for
    # With the first token of a request that asked for prompt_logprobs: each prompt token's (logprob, top) but
    # the first's, which nothing predicts.
    prompt: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()
    error: str | None = None  # the sequence's constraint failed: it ends with this error, the token unused
    # Speculation: the tokens kept after this one in the same step, in order (a verified draft, then the bonus).
    more: tuple[Sampled, ...] = ()
    # An embedding input's outcome instead of a token: its pooled, unit-length vector, float32 little-endian.
    embedding: bytes = b""


@dataclass(frozen=True, slots=True)
class DraftRow:
    """A decoding row the draft model (``--draft-model``) proposes ``k`` tokens for, before the step that verifies
    them: ``context`` is everything the target's cache holds once that step has fed the row's token (its prompt and
    its output, that token last). Rank 0 alone reads it (``rank.head.drafter``)."""

    seq: int
    context: list[int]
    k: int
    params: SamplingParams
