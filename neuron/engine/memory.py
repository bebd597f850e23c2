"""The memory budget: what every rank's caches may hold, read from the memory each rank really has, and what the
batch and the prefix cache take of it. The leader's alone; decisions only, no MLX and no I/O.

Why: eight ordinary long requests on a host with a memory limit got the leader killed by the kernel's OOM killer,
and every stream with it. On a Linux CPU host nothing fails before that (overcommit: an allocation succeeds, and
the process is killed when the pages are touched), and MLX does not enforce its own limit there, so the budget is
neuron's own accounting, and must hold by itself.

Each rank reads its memory (``rpc.Memory``): the room left before its binding limit (its memory cgroup's, its
GPU's, else its host's), what its caches hold, and the most one step has taken beyond them. Its caches may hold

    budget = room + caches - steps - headroom

``room`` is read live, so the weights, a draft model, LoRA adapters, the images held and every other process on
the host are counted as they are; what the caches hold now can be given back, so it is budget. ``steps`` is kept
free for one step's transient memory: the most a step took on the rank, at least what a ``--prefill-chunk``
prompt takes (scaled from the calibration step, a share of a chunk fed when the engine starts), with the attention
scores of such a chunk at the longest context the budget holds. ``headroom`` is ``HEADROOM_SHARE`` of the rank's
memory, at least ``HEADROOM_MIN``: the allocator's slack, the Python heap, the HTTP server's buffers.

Ranks hold different shares (pipeline stages of different lengths; a draft model beside rank 0). Each rank's
budget is turned into the reference share's bytes (the most any rank holds of a token's keys and values, and of a
sequence's whatever its length: what the prefix index counts in) by the ratio of their shares, and the least
rules: under tensor parallelism the smallest rank's budget, under pipeline parallelism each stage's for its layers.

What the batch holds is what mlx-lm's caches allocate: a micro-batch's rows are padded to its longest row, and a
cache grows ``STEP`` tokens at a time, so a micro-batch of r rows whose longest is L tokens holds r x (L + STEP)
tokens' keys and values. A sequence counts at least its reservation: its tokens when admitted and ``RESERVE``
more for its output; past that, it grows, and the scheduler preempts the newest sequence when the batch would
outgrow the budget. The prefix cache takes what the batch leaves, and is evicted first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from neuron.engine.drafts import MAX_K
from neuron.engine.sequence import Sequence as Seq
from neuron.rpc import Memory

STEP = 256  # tokens a cache grows by at a time (mlx-lm's KVCache.step): up to this many more are held than fed
# A sequence's room to grow when admitted: one growth of its cache, so that a reply up to this long never waits on
# another's; a longer one grows into what the batch leaves, or is preempted for it.
RESERVE = STEP
HEADROOM_SHARE = 0.05
HEADROOM_MIN = 64 << 20
SCORE_BYTES = 4  # an attention score, at the worst in float32
# The calibration step feeds a chunk's share this small and scales what it took up by as much: what a step takes
# beyond its caches grows with its tokens (attention scores, which grow with the context, are counted apart), and a
# whole chunk made every start pay a long prefill, the longer on a slow BLAS or ranks sharing cores.
CALIBRATION_SHARE = 8
# After an allocation failed anyway, the batch resumes within this share of what its caches held then, for this
# long: the budget read a moment before missed something (another process's burst, a transient of MLX's own), and
# what it missed may pass.
AFTER_FAILURE = 0.75
AFTER_FAILURE_S = 300.0


@dataclass(frozen=True, slots=True)
class Share:
    """What one rank holds of each sequence's caches and computes of each step's attention."""

    per_token: int  # bytes of keys and values per token
    per_sequence: int  # bytes whatever the length: a sliding window's buffer, a linear-attention state
    heads: int  # query heads of a layer computed here: a prompt chunk's attention scores


@dataclass(frozen=True, slots=True)
class RankBudget:
    """One rank's memory as last read, and how much of it its caches may hold (its own bytes)."""

    rank: int
    host: str
    total: int  # the most the rank may hold in all: its cgroup's limit, its GPU's memory, its host's
    used: int  # what its process holds
    room: int  # what it could still take before its limit
    caches: int  # what its caches hold now
    steps: int  # kept free for one step's transient memory
    images: int  # kept free for the images of requests in flight (rank 0, a model that takes images)
    headroom: int
    budget: int  # what its caches may hold: room + caches - steps - images - headroom
    longest: int  # the longest sequence, in tokens, its caches hold alone
    per_token: int  # what its caches hold of a token (its share)

    @property
    def mlx_limits(self) -> tuple[int, int]:
        """What MLX may hold in all on this rank (all it holds now and the room left, less the headroom), and the
        freed buffers it may keep for reuse (a step's transient memory): set where MLX enforces them."""
        return max(0, self.used + self.room - self.headroom), self.steps

    def describe(self) -> dict[str, int | str]:
        """Where the rank's memory goes, as the status route and the log show it."""
        return {
            "rank": self.rank,
            "host": self.host,
            "total_bytes": self.total,
            "used_bytes": self.used,
            "free_bytes": self.room,
            "caches_bytes": self.caches,
            "steps_bytes": self.steps,
            "images_bytes": self.images,
            "headroom_bytes": self.headroom,
            "budget_bytes": self.budget,
            "budget_tokens": self.budget // max(1, self.per_token),
            "longest_tokens": self.longest,
        }


def headroom(total: int) -> int:
    return max(HEADROOM_MIN, int(total * HEADROOM_SHARE))


def rank_budget(
    rank: int,
    host: str,
    memory: Memory,
    share: Share,
    calibrated: int,
    chunk: int,
    context: int,
    images: int = 0,
    part: float = 1.0,
) -> RankBudget:
    """``rank``'s budget from its reading ``memory``: ``calibrated`` is what the calibration step took beyond the
    caches, ``chunk`` the prompt tokens a step feeds at most, ``context`` the longest sequence the model takes,
    ``images`` what the images of the requests in flight may take, ``part`` this server's part of what is free and
    what its caches hold (``--memory-share``: servers of several models on one host, each sizing from its part,
    together never budget more than there is).

    The longest sequence its caches can hold is the longest whose own keys and values, with a chunk's attention
    scores at its end kept free beside them, fit: no sequence grows past that, so no step computes longer scores.
    """
    spare = headroom(memory.total)
    available = int((memory.free + memory.caches) * part) - spare - images
    scores = chunk * share.heads * SCORE_BYTES  # a chunk's attention scores, per token of context
    fixed = available - calibrated - STEP * share.per_token - share.per_sequence
    longest = max(0, min(context, fixed // max(1, share.per_token + scores)))
    steps = max(memory.peak, calibrated + longest * scores)
    budget = max(0, available - steps)
    if share.per_token:
        longest = max(0, min(longest, (budget - share.per_sequence) // share.per_token - STEP))
    return RankBudget(
        rank,
        host,
        memory.total,
        memory.used,
        memory.free,
        memory.caches,
        steps,
        images,
        spare,
        budget,
        longest,
        share.per_token,
    )


def reservation(seq: Seq) -> int:
    """The tokens ``seq``'s caches are reserved when it is admitted: its tokens, and ``RESERVE`` more for the output
    it may still produce (an embedding input produces none)."""
    if seq.pooling is not None:
        return len(seq.prompt)
    return len(seq.tokens) + max(0, min(RESERVE, seq.max_tokens - seq.completion_tokens))


def extent(seq: Seq) -> int:
    """The tokens ``seq``'s caches may hold by the end of the next step: its reservation, or more once it has
    grown past it (its token and a draft fed this step)."""
    return max(seq.reserved, seq.held + 1 + MAX_K) if seq.held else seq.reserved


def rows_by_micro_batch(filling: Iterable[Seq], running: Iterable[Seq], micro_batches: int) -> list[list[int]]:
    """Each micro-batch's rows, as the extents of its sequences: a prompt being fed in the micro-batch it will join
    (the one with the fewest rows, as the scheduler places it)."""
    rows: list[list[int]] = [[] for _ in range(micro_batches)]
    for seq in running:
        rows[seq.micro_batch].append(extent(seq))
    for seq in filling:
        min(rows, key=len).append(extent(seq))
    return rows


def overflow(
    budget: Budget, filling: Iterable[Seq], running: Iterable[Seq], micro_batches: int
) -> tuple[list[Seq], Seq | None]:
    """Whom to preempt, the newest admitted first, so that the batch's caches fit ``budget`` by the end of the next
    step; and the one generating sequence left that still does not fit alone (the budget shrank below it), if any.
    Embedding inputs are never preempted: they leave as soon as they are fed."""
    filling, running = list(filling), list(running)
    preempted: list[Seq] = []
    while not budget.fits(rows_by_micro_batch(filling, running, micro_batches)):
        generating = [seq for seq in (*filling, *running) if seq.pooling is None]
        if len(generating) <= 1:
            return preempted, generating[0] if generating else None
        newest = max(generating, key=lambda seq: seq.admitted)
        preempted.append(newest)
        (filling if newest in filling else running).remove(newest)
    return preempted, None


def admitted(budget: Budget, rows: list[list[int]], members: Iterable[Seq]) -> list[list[int]] | None:
    """The batch's rows (``rows_by_micro_batch``) once ``members`` join it, each at its reservation, where they fit
    ``budget``; None where they do not."""
    trial = [list(extents) for extents in rows]
    for member in members:
        min(trial, key=len).append(reservation(member))
    return trial if budget.fits(trial) else None


def held(rows: Iterable[list[int]]) -> tuple[int, int]:
    """The tokens' worth of keys and values and the sequences the caches of micro-batches of these rows hold (each
    a list of its rows' extents): every row padded to its micro-batch's longest, and a growth step more."""
    tokens = count = 0
    for extents in rows:
        if extents:
            tokens += len(extents) * (max(extents) + STEP)
            count += len(extents)
    return tokens, count


class Budget:
    """Every rank's budget, and the one that rules, in the reference share's bytes (``reference``: the most any rank
    holds of each kind of cache, what the prefix index counts in)."""

    def __init__(
        self, shares: Sequence[Share], hosts: Sequence[str], chunk: int, context: int, part: float = 1.0
    ) -> None:
        self.chunk = chunk
        self.context = context
        self.part = part  # of each rank's memory (``rank_budget``)
        self.reshape(shares, hosts)

    def reshape(self, shares: Sequence[Share], hosts: Sequence[str]) -> None:
        """Each rank's share of a sequence's caches, on its host: at start, and again when the group shrank
        (``Roster.shrink_due``); nothing is known of any rank until the calibration step has run again."""
        self.shares = list(shares)
        self.hosts = list(hosts)
        # The most any rank holds of each kind (``models.cache_bytes``): a sequence's bytes on this scale are at
        # least its bytes on any rank scaled up by the ratio ``_scaled`` uses, so a budget counted in them holds on
        # every rank, whichever kind of cache each holds (a pipeline stage of sliding windows only holds no bytes
        # per token).
        self.reference = Share(
            max(share.per_token for share in self.shares),
            max(share.per_sequence for share in self.shares),
            max(share.heads for share in self.shares),
        )
        self.calibrated: dict[int, int] = {}  # what the calibration step took on each rank
        self.ranks: list[RankBudget] = []
        self.binding = 0  # the rank whose budget rules
        self.bytes = 0  # what the caches may hold, in the reference share's bytes
        self.cap: int | None = None  # lowered after an allocation failed anyway (``AFTER_FAILURE``)
        self.cap_until = 0.0  # monotonic time the cap lifts
        self.images = 0  # kept free on rank 0 for the images of requests in flight (a model that takes images)

    @property
    def known(self) -> bool:
        """Whether every rank has been read."""
        return len(self.ranks) == len(self.shares)

    @property
    def calibration_tokens(self) -> int:
        """The prompt the calibration step feeds: ``CALIBRATION_SHARE`` of a chunk."""
        return -(-self.chunk // CALIBRATION_SHARE)

    def calibrate(self, readings: Mapping[int, Memory]) -> None:
        """The readings right after the calibration step: what a chunk's step takes on each rank beyond the caches,
        scaled up from the calibration step's share of a chunk (``calibration_tokens``)."""
        scale = self.chunk / self.calibration_tokens
        self.calibrated = {rank: math.ceil(memory.peak * scale) for rank, memory in readings.items()}
        self.read(readings)

    def read(self, readings: Mapping[int, Memory], now: float | None = None) -> None:
        """Every rank's latest reading (a rank not read yet keeps none); the budget that rules follows."""
        ranks = [
            rank_budget(
                rank,
                self.hosts[rank] if rank < len(self.hosts) else "?",
                readings[rank],
                share,
                self.calibrated.get(rank, 0),
                self.chunk,
                self.context,
                self.images if rank == 0 else 0,
                self.part,
            )
            for rank, share in enumerate(self.shares)
            if rank in readings
        ]
        if len(ranks) < len(self.shares):
            return
        self.ranks = ranks
        if self.cap is not None and (time.monotonic() if now is None else now) >= self.cap_until:
            self.cap = None
        scaled = [self._scaled(budget.budget, self.shares[budget.rank]) for budget in ranks]
        self.binding = min(range(len(ranks)), key=scaled.__getitem__)
        self.bytes = scaled[self.binding] if self.cap is None else min(scaled[self.binding], self.cap)

    def _scaled(self, budget: int, share: Share) -> int:
        """``budget`` bytes of a rank holding ``share``, in the reference share's bytes: the same tokens and
        sequences, at the least."""
        pairs = ((self.reference.per_token, share.per_token), (self.reference.per_sequence, share.per_sequence))
        ratios = [ref / own for ref, own in pairs if own]
        return int(budget * min(ratios, default=1.0))

    def usage(self, rows: Iterable[list[int]]) -> int:
        """The bytes, the reference share's, the caches of micro-batches of these rows (each a list of extents)
        hold."""
        return self._bytes(*held(rows), self.reference)

    def fits(self, rows: Iterable[list[int]]) -> bool:
        """Whether the caches of micro-batches of these rows fit every rank's budget (each in its own bytes: a
        stage may hold another kind of cache than the others), within the cap after a failed allocation."""
        tokens, count = held(rows)
        if self.cap is not None and self._bytes(tokens, count, self.reference) > self.cap:
            return False
        return len(self.ranks) == len(self.shares) and all(
            self._bytes(tokens, count, self.shares[budget.rank]) <= budget.budget for budget in self.ranks
        )

    def longest(self, n: int = 1) -> int:
        """The longest sequence, in tokens, of which ``n`` copies fit alone in the budget now."""
        shares = [(self.shares[budget.rank], budget.budget) for budget in self.ranks]
        if self.cap is not None:
            shares.append((self.reference, self.cap))
        longest = self.context
        for share, budget in shares:
            if n * share.per_sequence > budget:
                return 0
            if share.per_token:
                longest = min(longest, (budget // n - share.per_sequence) // share.per_token - STEP)
        return max(0, longest)

    @staticmethod
    def _bytes(tokens: int, count: int, share: Share) -> int:
        return tokens * share.per_token + count * share.per_sequence

    def lower_after_failure(self, held: int, now: float | None = None) -> int:
        """An allocation failed anyway while the caches held ``held`` reference bytes: for ``AFTER_FAILURE_S`` the
        budget is at most ``AFTER_FAILURE`` of that (lower still after another), so that the batch resumes with
        fewer rows. Returns the cap."""
        self.cap = int(held * AFTER_FAILURE) if self.cap is None else min(self.cap, int(held * AFTER_FAILURE))
        self.cap_until = (time.monotonic() if now is None else now) + AFTER_FAILURE_S
        self.bytes = min(self.bytes, self.cap)
        return self.cap

    def where(self) -> tuple[int, str]:
        """The rank whose budget rules, and its host."""
        return self.binding, self.hosts[self.binding] if self.binding < len(self.hosts) else "?"

    def scored_chunk(self, vocab_size: int) -> int:
        """The most prompt tokens a step may score (every position's logits, ``prompt_logprobs``), so that their
        logits stay within what the calibration step took on rank 0, where they are drawn."""
        calibrated = self.calibrated.get(0, 0)
        return max(1, min(self.chunk, calibrated // max(1, vocab_size * SCORE_BYTES)))
