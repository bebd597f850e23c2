"""A step's plan: what every rank runs of a step (``neuron.step.Step``, the step's one contract, holds it), the
same for every rank, and the part of the step that crosses the wire.

Every rank reads what to feed, keep and drop from it alone, and it fixes every tensor shape, so the ranks issue the
same collectives. It travels inside ``GenerateStep`` (``rpc.messages``). No MLX here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ImageRun:
    """Positions ``[at, at + count)`` of a prompt chunk take rows ``[first, first + count)`` of the features of the
    image ``digest`` in place of their tokens' embeddings. Rank 0 encodes the image (it holds its pixels); under
    tensor parallelism the others take the rows from a sum in which rank 0 alone gives them, so the plan alone
    fixes the shapes."""

    at: int
    count: int
    digest: str
    first: int


@dataclass(frozen=True, slots=True)
class Prefill:
    """A chunk of one sequence's prompt, fed at ``position`` (0 starts the sequence).

    ``last`` marks the chunk that ends the prompt: rank 0 gets that sequence's
    next-token logits, and the sequence joins the batch in a later step's decode.
    """

    seq: int
    position: int
    tokens: list[int]
    last: bool
    # Sequences that start as copies of this one when its prompt ends (a request's n > 1): each gets a copy of
    # its KV cache and the same next-token logits, so the prompt is computed once for all n.
    copies: list[int] = field(default_factory=list)
    # Rank 0 wants the logits of every position of this chunk (prompt scoring, ``echo`` with ``logprobs``); every
    # rank feeds it on its own, apart from the batch of new prompts, so all issue the same collectives.
    scores: bool = False
    # An embedding input (``MEAN`` or ``LAST``, vLLM's pooling types; empty for a prompt to generate from): no
    # logits; when its last chunk is fed, rank 0 gets its final hidden states pooled so and scaled to unit length,
    # and every rank drops it at once (it never joins the batch, and no plan names it again).
    pool: str = ""
    images: list[ImageRun] = field(default_factory=list)  # where image features replace token embeddings
    # M-RoPE (Qwen3-VL): the chunk's tokens' positions, three rows (time, row, column) of ``len(tokens)``, where
    # they are not ``position + i`` (an image's tokens, and every token after one); empty: the plain ones.
    positions: list[list[int]] = field(default_factory=list)
    adapter: int = 0  # the LoRA adapter its forwards apply (``LoadAdapter``'s number); 0: the base model


@dataclass(frozen=True, slots=True)
class Decode:
    """One row of the batched decode: ``token`` (sampled in the previous step) is fed to ``seq``.

    ``micro_batch`` is the micro-batch the row belongs to, fixed when the
    sequence joins the batch: a pipeline runs each as a pass of its own, so
    that its stages work at the same time (always 0 without a pipeline).
    """

    seq: int
    token: int
    micro_batch: int
    # Speculation: tokens rank 0 proposes after ``token``, fed with it in the same forward; rank 0 keeps the
    # longest run its sampler agrees with. Rows of a micro-batch are padded to its longest ``[token] + draft``.
    draft: list[int] = field(default_factory=list)
    # Tokens this row was fed in the previous step that were not accepted (a rejected draft, the padding):
    # every rank drops them from the end of the row's KV cache before this step's forward.
    drop: int = 0
    # M-RoPE: how far the row's positions lag its cache's length (a prompt's images advanced them by less than
    # their tokens); 0 for text.
    rope_delta: int = 0
    adapter: int = 0  # the LoRA adapter applied to this row (``LoadAdapter``'s number); 0: the base model


@dataclass(frozen=True, slots=True)
class Restore:
    """Start ``seq`` from the first ``tokens`` of prefix-cache entry ``entry``; its prompt goes on from there."""

    seq: int
    entry: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Save:
    """Keep ``seq``'s KV cache as prefix-cache entry ``entry``: its whole prompt, fed by this step; or, with
    ``tokens``, the first ``tokens`` of a sequence that leaves in this step (its prompt and the output it was fed,
    which a chat's next turn resends), kept before it is dropped."""

    seq: int
    entry: int
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Evict:
    """Drop prefix-cache entry ``entry``; with a ``key``, written to the rank's prefix-cache folder first, under
    that name (``OpenPrefixDisk``)."""

    entry: int
    key: str = ""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Everything one batched step changes, the same for every rank.

    In this order: each ``save`` of a leaving sequence keeps it; the sequences
    in ``leave`` are dropped; each ``restore`` starts a sequence from a
    prefix-cache entry; sequences listed in ``decode``
    whose prompt ended in an earlier step join the batch, after those already
    in it; each ``prefill`` chunk is fed; the entries in ``evict`` are dropped
    and each other ``save`` keeps a prompt just fed as a new entry; then the batch
    decodes one token per sequence, in ``decode`` order. The plan alone fixes
    every tensor shape, so every rank issues the same collectives even when its
    own state disagrees.
    """

    leave: list[int] = field(default_factory=list)
    prefill: list[Prefill] = field(default_factory=list)
    decode: list[Decode] = field(default_factory=list)
    restore: list[Restore] = field(default_factory=list)
    save: list[Save] = field(default_factory=list)
    evict: list[Evict] = field(default_factory=list)
    # The scheduler expects the next step to decode the same rows one token each: a rank that holds the whole
    # step runs that one ahead, on the tokens it draws, before it reads them (``rank.ahead``).
    ahead: bool = False

    @property
    def prefill_tokens(self) -> int:
        return sum(len(chunk.tokens) for chunk in self.prefill)

    def widths(self) -> dict[int, int]:
        """Each micro-batch's width: the tokens each of its rows is fed this step, ``[token] + draft`` padded to
        the longest. The one rule for it: the ranks pad to it, the scheduler drops what was not kept, the cost
        model counts it."""
        out: dict[int, int] = {}
        for row in self.decode:
            out[row.micro_batch] = max(out.get(row.micro_batch, 0), 1 + len(row.draft))
        return out

    @property
    def rows_fed(self) -> int:
        """Tokens the decode rows are fed across the batch: each micro-batch's rows times its width."""
        widths = self.widths()
        return sum(widths[row.micro_batch] for row in self.decode)
