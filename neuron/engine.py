"""The engine: turns prompts into token steps on the pool, and steps back into text.

It owns the tokenizer, the sampling parameters of each request and the
streaming detokenizer. The pool owns the ranks; rank 0 applies the sampler the
engine hands it, so logits never leave rank 0's thread.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import structlog
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from neuron.log import progress
from neuron.pool import Deadlines, Pool
from neuron.tp.model import ModelError, check_shardable
from neuron.tp.sampling import Sampled, Sampler, SamplingParams

log = structlog.get_logger("neuron.engine")


class RequestError(ValueError):
    """A request the engine refuses as given; the message names the field and the limit."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One generated token: its id, the text it completed (may be empty mid-character), and its logprob."""

    token: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop" (end of sequence) or "length" (max_tokens or the context reached)
    prompt_tokens: int
    completion_tokens: int
    text: str  # what the detokenizer held back until the end (an incomplete character)


class Engine:
    def __init__(self, pool: Pool, tokenizer: TokenizerWrapper, model_path: Path, context_length: int) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.context_length = context_length

    @classmethod
    @asynccontextmanager
    async def open(
        cls, model_path: Path, world_size: int = 1, backend: str = "ring", deadlines: Deadlines | None = None
    ) -> AsyncIterator[Engine]:
        # Refuse a model that cannot be split before a single worker is spawned.
        config = check_shardable(model_path, world_size)
        text = config.get("text_config", config)
        context = int(text.get("max_position_embeddings") or config.get("max_position_embeddings") or 4096)
        tokenizer = load_tokenizer(model_path)
        async with Pool(world_size, backend, deadlines) as pool:
            with progress(f"loading {model_path.name} on {world_size} rank(s)", 1) as advance:
                await pool.load(model_path)
                advance()
            yield cls(pool, tokenizer, model_path, context)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            if not self.tokenizer.chat_template:
                raise ModelError(f"{self.model_path} has no chat template; drop --chat")
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
                )
            )
        return list(self.tokenizer.encode(prompt))

    async def generate(
        self, prompt: list[int], max_tokens: int, sampling: SamplingParams | None = None
    ) -> AsyncIterator[Chunk | Finish]:
        """Yield a ``Chunk`` per generated token, then one ``Finish``."""
        if not prompt:
            raise RequestError("the prompt is empty: it needs at least one token")
        if max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}")
        if len(prompt) >= self.context_length:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens but the model's context holds {self.context_length}; "
                "shorten the prompt"
            )
        sampling = sampling or SamplingParams()
        if problems := sampling.problems():
            raise RequestError("; ".join(problems))
        budget = min(max_tokens, self.context_length - len(prompt))
        sampler = Sampler(sampling)
        detokenizer = self.tokenizer.detokenizer
        detokenizer.reset()
        eos = self.tokenizer.eos_token_ids
        started = time.perf_counter()
        # Each request starts from an empty cache, whatever the last one left behind.
        await self.pool.clear_kv_cache()
        feed, offset, produced, reason = prompt, 0, 0, "length"
        while produced < budget:
            sampled: Sampled = await self.pool.step(feed, offset, sampler)
            offset += len(feed)
            if produced == 0:
                log.debug(
                    "prefill done", prompt_tokens=len(prompt), ms=round((time.perf_counter() - started) * 1000, 1)
                )
            if sampled.token in eos:
                reason = "stop"
                break
            produced += 1
            detokenizer.add_token(sampled.token)
            yield Chunk(sampled.token, detokenizer.last_segment, sampled.logprob)
            feed = [sampled.token]
        detokenizer.finalize()
        log.info(
            "request done",
            prompt_tokens=len(prompt),
            completion_tokens=produced,
            finish_reason=reason,
            ms=round((time.perf_counter() - started) * 1000, 1),
        )
        yield Finish(reason, len(prompt), produced, detokenizer.last_segment)
