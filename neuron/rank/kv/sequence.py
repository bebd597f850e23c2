"""What a rank holds of one sequence: how far its cache goes, the last token it was fed, its own cache while its
prompt is fed (the batch's once it decodes, ``rank.kv.batch``), and on rank 0 what a drafter reads of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from neuron.rank.kv import caches

MAX_SEEN = 256  # steps' hidden states a sequence keeps for its next draft: one resting that long starts afresh


@dataclass(frozen=True, slots=True)
class Seen:
    at: int  # the position of the first token fed
    tokens: list[int]
    hidden: mx.array  # (positions, hidden size)


@dataclass(slots=True)
class SeqState:
    position: int = 0  # tokens in its cache
    last: int = -1  # the last token it was fed
    cache: list[caches.Layer] | None = None  # its own, while the prompt is fed; None once in the batch
    prompt_done: bool = False
    pooled: mx.array | None = None  # an embedding input's final hidden states summed so far (rank 0, MEAN)
    # Rank 0, drafting with the model's prediction layers (rank.mtp): what each step since the last draft fed and
    # the final hidden states it computed there, oldest first, until the drafter takes them.
    seen: list[Seen] = field(default_factory=list)

    def saw(self, hidden: mx.array | None, tokens: list[int], at: int) -> None:
        """A step fed ``tokens`` from position ``at`` and computed ``hidden`` (positions, hidden size) at them;
        None: it kept none, and what came before no longer joins what comes after."""
        if hidden is None:
            self.seen.clear()
            return
        self.seen.append(Seen(at, tokens, hidden))
        del self.seen[:-MAX_SEEN]
