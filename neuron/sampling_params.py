"""What a request asks of generation: plain data, no MLX.

The HTTP server and the CLI fill ``SamplingParams`` and the engine checks them
(``problems``, the one place each limit is checked), before anything touches a
model; rank 0's sampler (``neuron.rank.head.sampler``) is built from them and answers
each step with a ``step.Sampled`` per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neuron.grammar import Constraint

# The window of recent tokens the penalties look at, as in mlx-lm's logits processors.
PENALTY_WINDOW = 20
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 4
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = None  # None: as many as the context leaves
    stop: tuple[str, ...] = ()  # strings that end the text; never part of it
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    min_p: float = 0.0
    seed: int | None = None
    # Additive penalties (OpenAI's) and a multiplicative one (mlx-lm's); all look at
    # the last PENALTY_WINDOW tokens of the sequence, the prompt included.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # None: no logprobs. n >= 0: the chosen token's logprob and the n most likely alternatives.
    logprobs: int | None = None
    # None: no prompt scores. n >= 0: each prompt token's logprob and the n most likely alternatives at its
    # position (vLLM's prompt_logprobs; ``echo`` with ``logprobs`` on /v1/completions), computed in the prefill.
    prompt_logprobs: int | None = None
    # What the output must match (response_format, forced tool calls), compiled by the engine; rank 0 masks with it.
    constraint: Constraint | None = None
    # vLLM's extensions, as vLLM defines them. The engine adds the model's end-of-sequence tokens to
    # ``stop_token_ids`` unless ``ignore_eos``: from then on they are the tokens that end the sequence, and
    # the ones rank 0's sampler holds back until ``min_tokens`` tokens are out (stop strings wait for it too).
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Speculation (engine.drafts). ``num_draft_tokens`` is mlx-lm's per-request name: at most this many draft
    # tokens per step, 0 for none; None: the server's setting. ``prediction``: OpenAI's predicted output text.
    num_draft_tokens: int | None = None
    prediction: str = ""

    def problems(self, vocab_size: int | None = None) -> list[str]:
        """What is wrong with these parameters, as messages naming each field."""
        out = []
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if value is not None and not allowed.holds(value):
                out.append(f"{'top_logprobs' if name == 'logprobs' else name} {allowed.requirement}, got {value}")
        for token, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= token < vocab_size:
                out.append(f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})")
                break
            if not LOGIT_BIAS.holds(bias):
                out.append(f"logit_bias values must lie in {LOGIT_BIAS}, got {bias} for token {token}")
                break
        if len(self.stop) > MAX_STOPS:
            out.append(f"stop holds at most {MAX_STOPS} strings, got {len(self.stop)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            out.append(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            out.append(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for token in self.stop_token_ids:
            if not 0 <= token < (vocab_size or 2**63):
                out.append(f"stop_token_ids names token {token}, outside the vocabulary [0, {vocab_size})")
                break
        return out


@dataclass(frozen=True, slots=True)
class Range:
    """An interval of allowed values, told once: the checks, the error messages and the OpenAPI schema read it."""

    low: float
    high: float | None = None  # None: no upper bound
    open_low: bool = False
    open_high: bool = False

    def holds(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        below = self.high is None or (value < self.high if self.open_high else value <= self.high)
        return above and below

    @property
    def requirement(self) -> str:
        """What a value must be, as an error message says it."""
        if self.high is None and not self.open_low:
            return f"must be at least {_number(self.low)}"
        return f"must lie in {self}"

    def __str__(self) -> str:
        opening = "(" if self.open_low else "["
        high, closing = ("∞", ")") if self.high is None else (_number(self.high), ")" if self.open_high else "]")
        return f"{opening}{_number(self.low)}, {high}{closing}"

    def json_schema(self) -> dict[str, float]:
        out = {"exclusiveMinimum" if self.open_low else "minimum": self.low}
        if self.high is not None:
            out["exclusiveMaximum" if self.open_high else "maximum"] = self.high
        return out


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


RANGES = {
    "max_tokens": Range(0),  # 0: the prompt alone, scored (echo)
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, open_low=True),
    "top_k": Range(0),  # 0 means no limit
    "min_p": Range(0.0, 1.0, open_high=True),
    "seed": Range(0, 2**63, open_high=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 10.0, open_low=True),
    "logprobs": Range(0, MAX_TOP_LOGPROBS),
    "prompt_logprobs": Range(0, MAX_TOP_LOGPROBS),
    "num_draft_tokens": Range(0, 64),
    "min_tokens": Range(0),
}
LOGIT_BIAS = Range(-100.0, 100.0)
