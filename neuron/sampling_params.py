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
        if not 0.0 <= self.temperature <= 2.0:
            out.append(f"temperature must lie in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            out.append(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            out.append(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            out.append(f"min_p must lie in [0, 1), got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            out.append(f"seed must lie in [0, 2**63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                out.append(f"{name} must lie in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            out.append(f"repetition_penalty must lie in (0, 10], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            out.append(f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        for token, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= token < vocab_size:
                out.append(f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})")
                break
            if not -100.0 <= bias <= 100.0:
                out.append(f"logit_bias values must lie in [-100, 100], got {bias} for token {token}")
                break
        return out
