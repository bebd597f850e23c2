"""Draft tokens without a draft model: prompt lookup, and the request's ``prediction``.

No MLX here: the scheduler asks each running sequence's ``Proposer`` for the
tokens likely to follow, every rank verifies them in the step's one batched
forward, and rank 0 keeps those its sampler agrees with (``tp.speculate``).

Where the drafts come from, best first: the tokenized ``prediction`` (OpenAI's
predicted outputs) while the output so far matches it; otherwise the tokens
that followed the last occurrence of the output's last n-gram in the
prediction, the prompt or the output itself (prompt lookup). Code edits,
quoting and extraction repeat their input, and there most drafts are kept.

Adaptive k: a draft costs forward work whether kept or not. Each sequence's
k grows while whole drafts are kept and halves when under half of it is; after
``MISSES`` such drafts in a row the sequence stops proposing for ``REST``
steps, twice as long each time in a row (until a whole draft is kept again),
so free chat runs as it would without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_K = 8  # draft tokens per step at most
START_K = 4
NGRAM = (3,)  # n-gram lengths looked up, longest first: 2-grams ("of the") mislead in free text
MISSES = 3
REST = 16  # steps without proposing after MISSES misses; doubled each time in a row, up to MAX_REST
MAX_REST = 128
WINDOW = 4096  # tokens searched back for an n-gram: a lookup stays cheap on long contexts


@dataclass(slots=True)
class Proposer:
    prediction: list[int] = field(default_factory=list)
    limit: int = MAX_K  # the request's own cap (num_draft_tokens)
    k: int = START_K
    misses: int = 0
    resting: int = 0  # steps left without proposing
    rest: int = REST  # the next rest's length
    proposed: int = 0  # totals, for usage and metrics
    accepted: int = 0

    def propose(self, context: list[int], output: list[int], room: int) -> list[int]:
        """Up to k tokens to follow ``context`` (prompt and output, up to the token about to be fed), at most
        ``room``; ``output`` is the completion so far, that token included."""
        k = min(self.k, self.limit, room)
        if k <= 0:
            return []
        if self.resting:
            self.resting -= 1
            return []
        done = len(output)
        if self.prediction and self.prediction[:done] == output and done < len(self.prediction):
            return self.prediction[done : done + k]
        return lookup(self.prediction, k, context) or lookup(context[-WINDOW:-1], k, context)

    def update(self, proposed: int, accepted: int) -> None:
        """A draft of ``proposed`` tokens was verified and ``accepted`` of them kept."""
        if not proposed:
            return
        self.proposed += proposed
        self.accepted += accepted
        if accepted == proposed:
            self.k, self.misses, self.rest = min(MAX_K, self.k * 2), 0, REST
        elif 2 * accepted >= proposed:
            self.k, self.misses = max(1, accepted + 1), 0
        else:  # a miss: under half kept, the rest of the draft was forward work for nothing
            self.k, self.misses = max(1, self.k // 2), self.misses + 1
            if self.misses >= MISSES:  # rest, longer each time in a row, so free chat pays next to nothing
                self.resting, self.misses, self.k = self.rest, 0, START_K
                self.rest = min(MAX_REST, self.rest * 2)


def lookup(source: list[int], k: int, context: list[int]) -> list[int]:
    """The k tokens that followed the last earlier occurrence in ``source`` of ``context``'s last n-gram."""
    for n in NGRAM:
        if len(context) < n:
            continue
        tail, start, last = context[-n:], 0, -1
        # list.index scans in C: a step's lookup stays well under a millisecond on a 4k-token context.
        while True:
            try:
                start = source.index(tail[0], start)
            except ValueError:
                break
            if source[start : start + n] == tail and start + n < len(source):
                last = start
            start += 1
        if last >= 0:
            return source[last + n : last + n + k]
    return []
