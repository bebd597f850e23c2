"""A request becomes sequences: every check a request can fail before it queues, and what each choice starts with.

No MLX and no pool here: the engine calls ``sequences`` from ``submit`` and
queues the first; what it refuses, it refuses before anything runs, naming the
field at fault.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Any

from neuron.engine.drafts import MAX_K, DraftRate, Proposer
from neuron.engine.memory import Budget
from neuron.engine.refusals import RequestError
from neuron.engine.scheduler import Scheduling
from neuron.engine.sequence import Sequence, StopText
from neuron.sampling_params import SamplingParams


@dataclass(slots=True)
class Intake:
    limits: Scheduling
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    tokenizer: Any  # the model's tokenizer: encodes a request's ``prediction``
    budget: Budget | None = None  # the memory budget: the longest sequences it holds now (``engine.memory``)
    numbers: itertools.count = dataclasses.field(default_factory=lambda: itertools.count(1))
    draft_rate: DraftRate = dataclasses.field(default_factory=DraftRate)  # the draft model's, over recent sequences

    def sequences(self, prompt: list[int], params: SamplingParams, request_id: str, n: int) -> list[Sequence]:
        """The ``n`` choices of one request, the first holding the others as ``copies``; raises ``RequestError``.

        With a seed, choice i draws with seed + i, so it is the choice a request with that seed alone gets.
        """
        if not prompt:
            raise RequestError("the prompt is empty: it needs at least one token", "prompt")
        if not all(0 <= t < self.vocab_size for t in prompt):
            raise RequestError(f"token ids must lie in [0, {self.vocab_size})", "prompt")
        if len(prompt) >= self.context_length:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.context_length}; shorten the prompt",
                "prompt",
                "context_length_exceeded",
            )
        if getattr(prompt, "images", ()) and params.prompt_logprobs is not None:
            raise RequestError(
                "prompt_logprobs are not computed for prompts with images; drop one or the other", "prompt_logprobs"
            )
        if problems := params.problems(self.vocab_size):
            raise RequestError("; ".join(problems), problems[0].split(" ", 1)[0])
        most = min(self.limits.max_n, self.limits.max_batch)
        if not 1 <= n <= most:
            raise RequestError(f"n must lie in [1, {most}] on this server (--max-n), got {n}", "n")
        if not params.ignore_eos:
            ends = (*params.stop_token_ids, *sorted(self.eos_token_ids))
            params = dataclasses.replace(params, stop_token_ids=ends)
        context = min(self.context_length, self._memory_holds(prompt, n))
        budget = min(context - len(prompt), self.limits.max_completion_tokens or self.context_length)
        max_tokens = budget if params.max_tokens is None else min(params.max_tokens, budget)
        seqs = []
        for i in range(n):
            seed = None if params.seed is None else (params.seed + i) % 2**63
            own = dataclasses.replace(params, seed=seed) if i else params
            stop = StopText(params.stop, params.include_stop_str_in_output)
            seqs.append(Sequence(request_id, next(self.numbers), list(prompt), max_tokens, own, stop))
            seqs[-1].images = getattr(prompt, "images", ())  # engine.vision.Prompt
            seqs[-1].rope = getattr(prompt, "rope", None)
            seqs[-1].proposer = self._proposer(params)
            seqs[-1].submitted = time.perf_counter()
        seqs[0].copies = seqs[1:]
        for copy in seqs[1:]:
            copy.copy_of = seqs[0]
        return seqs

    def _memory_holds(self, prompt: list[int], n: int) -> int:
        """The longest sequence of which the memory budget holds ``n`` alone now (as the context holds one): a
        prompt it cannot hold with one token more is refused here, the one place such refusals are made, and
        ``max_tokens`` is cut to what it leaves, as to what the context leaves."""
        if self.budget is None or not self.budget.known:
            return self.context_length
        longest = self.budget.longest(n)
        if len(prompt) < longest:
            return longest
        rank, host = self.budget.where()
        choices = f" and asks for {n} choices, each with caches of its own," if n > 1 else ""
        fewer = ", ask for fewer choices" if n > 1 else ""
        raise RequestError(
            f"the prompt has {len(prompt)} tokens{choices} but this server's memory holds the KV caches of at most "
            f"{longest} tokens {'each ' if n > 1 else ''}now, prompt and reply (a budget of "
            f"{_mib(self.budget.bytes)} for the caches, "
            f"rank {rank} on {host} the smallest); shorten the prompt{fewer}, or give that host more memory (or "
            "split the model over more: --tp, --pp)",
            "prompt",
            "context_length_exceeded",
        )

    def embeddings(self, prompts: list[list[int]], pooling: str, request_id: str) -> list[Sequence]:
        """An embedding request's inputs, a sequence each, pooled so; the first holds the others as its ``group``
        (queued as one request). Raises ``RequestError`` naming the input at fault (``input``, or ``input[i]``)."""
        if not prompts:
            raise RequestError("`input` holds no input: send at least one", "input")
        seqs = []
        for i, prompt in enumerate(prompts):
            where = f"input[{i}]" if len(prompts) > 1 else "input"
            if not prompt:
                raise RequestError(f"`{where}` is empty: it needs at least one token", where)
            if not all(0 <= t < self.vocab_size for t in prompt):
                raise RequestError(f"`{where}`: token ids must lie in [0, {self.vocab_size})", where)
            if len(prompt) > self.context_length:
                raise RequestError(
                    f"`{where}` has {len(prompt)} tokens but this model embeds at most {self.context_length} (its "
                    "context); shorten it, or send `truncate_prompt_tokens`",
                    where,
                    "context_length_exceeded",
                )
            seq = Sequence(request_id, next(self.numbers), list(prompt), 0, SamplingParams(), StopText(()))
            seq.pooling = pooling
            seq.submitted = time.perf_counter()
            seqs.append(seq)
        seqs[0].group = seqs[1:]
        return seqs

    def _proposer(self, params: SamplingParams) -> Proposer | None:
        """The sequence's draft source, or None where it does not speculate: the server's ``--speculate off``, the
        request's ``num_draft_tokens`` of 0, or an output constraint (rank 0's masks advance one token at a time,
        so a constrained row decodes without drafts, from a draft model too)."""
        if self.limits.speculate == "off" or params.num_draft_tokens == 0 or params.constraint is not None:
            return None
        text = params.prediction
        prediction = list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []
        if (self.limits.draft_model is not None or self.limits.speculate == "mtp") and not prediction:
            limit = params.num_draft_tokens or MAX_K
            return Proposer(limit=limit, lookup_rate=self.draft_rate.prior(), model=True, shared=self.draft_rate)
        return Proposer(prediction, params.num_draft_tokens or MAX_K)


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.0f} MiB"
