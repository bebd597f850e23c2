"""What a request asks of the sampler: plain data, no MLX.

The HTTP server and the CLI check these before anything touches a model, and
rank 0's sampler (``neuron.tp.sampler``) is built from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The window of recent tokens the penalties look at, as in mlx-lm's logits processors.
PENALTY_WINDOW = 20
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
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

    def problems(self, vocab_size: int | None = None) -> list[str]:
        """What is wrong with these parameters, as messages naming each field."""
        out = []
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if value is not None and not allowed.holds(value):
                out.append(f"{'top_logprobs' if name == 'logprobs' else name} must lie in {allowed}, got {value}")
        for token, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= token < vocab_size:
                out.append(f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})")
                break
            if not LOGIT_BIAS.holds(bias):
                out.append(f"logit_bias values must lie in {LOGIT_BIAS}, got {bias} for token {token}")
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
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, open_low=True),
    "top_k": Range(0),  # 0 means no limit
    "min_p": Range(0.0, 1.0, open_high=True),
    "seed": Range(0, 2**63, open_high=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 10.0, open_low=True),
    "logprobs": Range(0, MAX_TOP_LOGPROBS),
}
LOGIT_BIAS = Range(-100.0, 100.0)
