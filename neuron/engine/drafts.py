"""Draft tokens: prompt lookup, the request's ``prediction``, and how many a draft model proposes.

No MLX here: the scheduler asks each running sequence's ``Proposer`` for the
tokens likely to follow, every rank verifies them in the step's one batched
forward, and rank 0 keeps those its sampler agrees with (``rank.head.sampler.Run``; ``rank.kv.rollback`` drops the
rest from the caches).

Where the drafts come from, best first: the tokenized ``prediction`` (OpenAI's
predicted outputs) while the output so far matches it; otherwise the tokens
that followed the last occurrence of the output's last n-gram in the
output itself, the prediction or the prompt, in that order (prompt lookup). Code edits,
quoting and extraction repeat their input, and there most drafts are kept.

With a draft model (``--draft-model``) a sequence's proposer says how many tokens it wants
(``Proposer.wanted``), rank 0's draft model proposes them before the step's plan is made (``Scheduler.to_draft``,
``Pool.draft``), and the batch's rule cuts them as it cuts any draft. A request that sends a ``prediction`` keeps
its prediction and prompt lookup: the client says what the reply will be.

Adaptive k: a draft costs forward work whether kept or not. Each sequence's
k grows while whole drafts are kept and halves when under half of it is; after
``MISSES`` such drafts in a row the sequence stops proposing for ``REST``
steps, twice as long each time in a row (until a whole draft is kept again),
so free chat runs as it would without speculation.

The batch's cost rule (``width``): one row's draft pads its whole micro-batch
to its width, and where the forward is compute-bound (a CPU at batch 8) every
extra row of width costs nearly as much as a plain step's row. So each
micro-batch gets one width W, chosen to maximise expected tokens per unit of
step time, and every draft is cut to W - 1. ``StepCost`` is the step-time model
it weighs them with, which the engine refines from the steps it times. A draft model's
proposals cost steps of its own before the target's, one per draft token: the engine
times them apart (``StepCost.observe_draft``) and the rule adds W - 1 of them, so a
slow or useless draft model is cut to nothing rather than slowing every step.

The same step times price a prompt's tokens (``StepCost.observe_prompt``): the scheduler sizes a prompt's chunk
beside decoding streams by them (``scheduler.prefill_budget``).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_K = 8  # draft tokens per step at most
START_K = 4
NGRAM = (3,)  # n-gram lengths looked up, longest first: 2-grams ("of the") mislead in free text
MISSES = 3
REST = 16  # steps without proposing after MISSES misses; doubled each time in a row, up to MAX_REST
MAX_REST = 128
WINDOW = 4096  # tokens searched back for an n-gram: a lookup stays cheap on long contexts
# Per-token acceptance estimates (the chance a draft token is kept given those before it were), before evidence:
# a coin for prompt lookup; high for a prediction the output has matched so far, since the client says the reply
# will be that text, and where it is right most of it is kept (tests/e2e/speculation/test_speculate.py: 3+ tokens
# kept per verify step).
LOOKUP_PRIOR = 0.5
PREDICTION_PRIOR = 0.9
# A draft model made to agree with its target: most of its tokens are kept until the evidence says otherwise.
# Then a new sequence starts from the draft's rate over the server's recent sequences (``DraftRate``), not under
# MODEL_FLOOR: low enough that a useless draft is not tried again by every request where a draft's width costs
# (a CPU), high enough that it is where a width is nearly free (a GPU), so the rate can recover.
MODEL_PRIOR = 0.7
MODEL_FLOOR = 0.1
SMOOTHING = 0.1  # the EWMA's weight per observed draft token: about the last 10-20 tokens count


@dataclass(slots=True)
class DraftRate:
    """The draft model's per-token acceptance over the server's recent sequences (one per server)."""

    rate: float = MODEL_PRIOR

    def prior(self) -> float:
        return max(MODEL_FLOOR, self.rate)


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
    lookup_rate: float = LOOKUP_PRIOR  # acceptance estimates, one per draft source: they differ a lot
    prediction_rate: float = PREDICTION_PRIOR
    following: bool = False  # the last draft came from the prediction, the output matching it so far
    last: list[int] = field(default_factory=list)  # the last draft proposed, before the batch's rule cut it
    last_at: int = 0  # the output's length when it was proposed
    withheld: list[int] = field(default_factory=list)  # a draft the rule cut whole, checked against the output
    withheld_at: int = 0
    following_withheld: bool = False  # whether it came from the prediction
    model: bool = False  # the draft model proposes (``Scheduler.to_draft``), not prompt lookup
    shared: DraftRate | None = None  # the server's draft-model rate, which this sequence's verdicts move too

    @property
    def acceptance(self) -> float:
        """The estimated chance that each token of the last draft is kept, given those before it were."""
        return self.prediction_rate if self.following else self.lookup_rate  # a model's rate is lookup_rate

    def wanted(self, room: int) -> int:
        """How many tokens the draft model is to propose for the next step (``model``), at most ``room``: none
        while resting. Changes nothing: ``propose`` takes the proposal."""
        return 0 if self.resting else max(0, min(self.k, self.limit, room))

    def propose(self, prompt: list[int], output: list[int], room: int, proposed: list[int] | None = None) -> list[int]:
        """Up to k tokens to follow the prompt and ``output`` (the completion so far, up to the token about to be
        fed), at most ``room``; where the draft model proposes (``model``), ``proposed`` is its proposal."""
        self._check_withheld(output)
        self.last, self.last_at = self._propose(prompt, output, room, proposed or []), len(output)
        return self.last

    def _propose(self, prompt: list[int], output: list[int], room: int, proposed: list[int]) -> list[int]:
        k = min(self.k, self.limit, room)
        if k <= 0:
            return []
        if self.resting:  # before the context is built: a resting sequence costs its step next to nothing
            self.resting -= 1
            return []
        if self.model:
            return proposed[:k]
        context = prompt + output
        done = len(output)
        self.following = bool(self.prediction) and self.prediction[:done] == output and done < len(self.prediction)
        if self.following:
            return self.prediction[done : done + k]
        # The output first: where the model rewrites its input (renames a variable), the output shows the rewrite
        # and the prediction and the prompt the original. Then the prediction, then the prompt. Without a
        # prediction one scan of the context does both: its last occurrence is the output's, where there is one.
        if self.prediction and (found := lookup(output[-WINDOW:-1], k, context) or lookup(self.prediction, k, context)):
            return found
        return lookup(context[-WINDOW:-1], k, context)

    def _check_withheld(self, output: list[int]) -> None:
        """Score a draft the batch's rule did not feed against the token the step sampled in its place.

        Without this, a sequence whose drafts are always cut (batch 8 starts at the lookup prior, which does not
        pay there) would never learn that its drafts are good. Only the first token counts: a step without drafts
        samples one token, and the geometric model needs nothing more. Greedy, this is the verifier's own verdict;
        sampled, the token is a draw from the distribution the verifier would have drawn from.
        """
        if self.withheld and len(output) > self.withheld_at and not self.model:  # no model draft was drawn
            self._observe(output[self.withheld_at] == self.withheld[0], self.following_withheld)
        self.withheld = []

    def _observe(self, kept: bool, following: bool) -> None:
        if following:
            self.prediction_rate += SMOOTHING * (kept - self.prediction_rate)
        else:
            self.lookup_rate += SMOOTHING * (kept - self.lookup_rate)
        if self.shared is not None:
            self.shared.rate += SMOOTHING * (kept - self.shared.rate)

    def update(self, proposed: int, accepted: int) -> None:
        """A draft of ``proposed`` tokens (the last draft, as the batch's rule cut it) was verified and ``accepted``
        of them kept."""
        if not proposed:
            # Cut whole (or none): not a miss, k and the rest stay; the next token sampled tells whether it was right.
            self.withheld, self.withheld_at, self.following_withheld = self.last, self.last_at, self.following
            return
        # Geometric: each kept token is a success, the first rejected one a failure, those after it tell nothing.
        for _ in range(accepted):
            self._observe(True, self.following)
        if accepted < proposed:
            self._observe(False, self.following)
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


def expected_kept(drafted: int, acceptance: float) -> float:
    """Draft tokens expected to be kept of ``drafted``: token i is kept only if all before it were."""
    return sum(acceptance**i for i in range(1, drafted + 1))


# The step-time prior: SmolLM2-135M on the 2-core development CPU at batch 1 and batch 8, one token per row
# (BENCHMARKS.md, "Speculative decoding"). Its ratio is what matters until the engine has timed steps of
# different widths.
PRIOR_FIXED_MS = 43.5
PRIOR_ROW_MS = 6.5
COST_WINDOW = 64  # decode steps the fit looks back on: recent enough to follow the batch's size
MIN_SAMPLES = 3  # steps timed at a row count before its median counts
PROMPT_WINDOW = 8  # steps feeding a prompt that its tokens' cost is fitted over
MIN_SPAN = 4  # rows between the fewest and the most fed before the slope is fitted rather than assumed


class WindowMedians:
    """The last ``size`` (rows, ms) steps, kept sorted by row count so that each step updates the medians in
    place: ``StepCost.observe`` runs on the engine loop every step, where rebuilding them over the window showed
    in the profile (BENCHMARKS.md, issue 49)."""

    def __init__(self, size: int) -> None:
        self.steps: deque[tuple[int, float]] = deque()
        self.size = size
        self.by_rows: dict[int, list[float]] = {}  # row count -> its times in the window, sorted

    def add(self, rows: int, ms: float) -> list[tuple[int, float, int]]:
        """Adds a step (dropping the oldest past ``size``); returns (rows, median ms, steps) for each row count
        timed at least ``MIN_SAMPLES`` times, in the order the row counts first appear in the window."""
        self.steps.append((rows, ms))
        bisect.insort(self.by_rows.setdefault(rows, []), ms)
        if len(self.steps) > self.size:
            old_rows, old_ms = self.steps.popleft()
            times = self.by_rows[old_rows]
            del times[bisect.bisect_left(times, old_ms)]
            if not times:
                del self.by_rows[old_rows]
        order: Iterable[int] = self.by_rows
        if len(self.by_rows) > 1:  # the order a rebuild from the window gives, so that the fit's sums match it
            first: dict[int, None] = {}
            for r, _ in self.steps:
                if r not in first:
                    first[r] = None
                    if len(first) == len(self.by_rows):
                        break
            order = first
        return [(r, ts[len(ts) // 2], len(ts)) for r in order if len(ts := self.by_rows[r]) >= MIN_SAMPLES]


@dataclass(slots=True)
class StepCost:
    """A decode step's time: ``fixed_ms + row_ms * rows``, rows being the tokens fed across the batch (B x W).

    ``fixed_ms`` is what a step costs however narrow (the weights read once, the ranks' collectives and IPC),
    ``row_ms`` what each token fed adds. The engine times its decode-only steps (``observe``); the model is
    refitted from them: by least squares over the median time at each row count seen in the last ``COST_WINDOW``
    steps, medians because a step that waited on another process would skew a mean. Until the row counts seen
    span ``MIN_SPAN`` rows (a batch that stays the same size, drafts cut to nothing) a slope fitted would be
    noise, so the prior's ratio row_ms / fixed_ms stays and only the scale follows the times measured.

    A row count timed ``MIN_SAMPLES`` times is priced at its own median, not the line's: the cost is no line
    where one row goes to a cheaper kernel (``neuron/system/native/gemv.c``: one-row products by sgemv, two rows and
    more by sgemm: BENCHMARKS.md, "Decode toward the bandwidth"), and a draft must pay for that step.

    A step that feeds a prompt prices its prompt tokens from the same times (``observe_prompt``): what the line
    says its decode rows cost, the rest is the prompt's. The scheduler sizes a prompt's chunk by it
    (``scheduler.prefill_budget``).
    """

    fixed_ms: float = PRIOR_FIXED_MS
    row_ms: float = PRIOR_ROW_MS
    window: WindowMedians = field(default_factory=lambda: WindowMedians(COST_WINDOW))
    measured: dict[int, float] = field(default_factory=dict)  # row count -> median ms, where timed enough
    # A draft model's (or prediction layer's) time per draft token it proposes, the batch's rows together: its k
    # steps run one after another before the step, so a width of W costs W - 1 of them on top of the step's time.
    # The median over the last COST_WINDOW drafts, from MIN_SAMPLES on (0 before: nothing is known to be slow
    # yet); the median, since a sequence's first draft also feeds the draft its prompt.
    draft_times: deque[float] = field(default_factory=lambda: deque(maxlen=COST_WINDOW))
    draft_step_ms: float = 0.0
    # What the prompt tokens a step feeds add to it, beside its decode rows (priced by the line above):
    # ``token_ms`` a token, and ``pair_ms`` for each earlier token of its prompt it attends to, since a token costs
    # more the deeper into its prompt it sits. Fitted over the last PROMPT_WINDOW steps that fed a prompt, from
    # MIN_SAMPLES on (None before: nothing measured yet).
    prompt_steps: deque[tuple[int, float, float]] = field(default_factory=lambda: deque(maxlen=PROMPT_WINDOW))
    token_ms: float | None = None
    pair_ms: float = 0.0
    lined: bool = False  # whether the window's steps were priced past a timed decode line (else charged whole)

    def ms(self, rows: int, share: float = 1.0) -> float:
        """A step of ``rows`` tokens; with ``share`` < 1, a pipeline micro-batch's part (``share`` of the fixed
        time: the medians, timed over whole steps, do not apply)."""
        if share == 1.0 and rows in self.measured:
            return self.measured[rows]
        return share * self.fixed_ms + self.row_ms * rows

    def observe_draft(self, steps: int, ms: float) -> None:
        """A draft model proposed ``steps`` tokens for each drafting row, in ``ms``."""
        if steps <= 0 or ms <= 0:
            return
        self.draft_times.append(ms / steps)
        if len(self.draft_times) >= MIN_SAMPLES:
            self.draft_step_ms = sorted(self.draft_times)[len(self.draft_times) // 2]

    def observe_prompt(self, tokens: int, pairs: float, rows: int, ms: float) -> None:
        """A step fed ``tokens`` prompt tokens, attending to ``pairs`` (token, earlier token) pairs of their prompts
        (``attended``), beside ``rows`` decode tokens, and took ``ms``: what the decode rows cost by the line (its
        fixed time with none), the prompt tokens cost the rest. Until decode steps are timed the line is the
        prior's, which may be far off on this machine (far more than a small model's whole step): then the whole
        step is the prompt's, which prices its tokens high, the side a chunk is safe on."""
        if tokens <= 0 or ms <= 0:
            return
        decode = self.ms(rows) if self.measured else 0.0
        if self.measured and self.prompt_steps and not self.lined:  # the steps charged whole would skew the fit
            self.prompt_steps.clear()
        self.lined = bool(self.measured)
        self.prompt_steps.append((tokens, pairs, max(0.0, ms - decode)))
        if len(self.prompt_steps) < MIN_SAMPLES:
            return
        # Least squares through the origin, ms = token_ms * tokens + pair_ms * pairs, neither negative: a step that
        # waited on another process prices tokens high, and the next chunk is smaller, the safe side.
        steps = self.prompt_steps
        tt = sum(n * n for n, _, _ in steps)
        tp = sum(n * p for n, p, _ in steps)
        pp = sum(p * p for _, p, _ in steps)
        ty = sum(n * y for n, _, y in steps)
        py = sum(p * y for _, p, y in steps)
        det = tt * pp - tp * tp
        token_ms = (ty * pp - py * tp) / det if det > 1e-9 * tt * pp else -1.0
        pair_ms = (py * tt - ty * tp) / det if det > 1e-9 * tt * pp else -1.0
        if token_ms < 0 or pair_ms < 0:  # too few depths to tell the two apart, or noise: a token's price alone
            token_ms, pair_ms = ty / tt, 0.0
        self.token_ms, self.pair_ms = token_ms, pair_ms

    @property
    def largest_chunk(self) -> int:
        """The most prompt tokens a step of the window fed: the chunk's price is known up to there."""
        return max((n for n, _, _ in self.prompt_steps), default=0)

    def prompt_fits(self, ms: float, depth: int) -> float:
        """How many prompt tokens fit in ``ms``, fed from ``depth`` on (each attends to those before it); inf where
        they cost nothing measurable. Only once ``token_ms`` is known."""
        a, b = self.token_ms or 0.0, self.pair_ms
        if ms <= 0:
            return 0.0
        if b <= 0:  # a n + b attended(depth, n) <= ms, solved for n
            return ms / a if a > 0 else math.inf
        slope = a + b * depth
        return (math.sqrt(slope * slope + 2 * b * ms) - slope) / b

    def observe(self, rows: int, ms: float) -> None:
        """A decode step fed ``rows`` tokens and took ``ms``."""
        if rows <= 0 or ms <= 0:
            return
        points = self.window.add(rows, ms)
        self.measured = {r: t for r, t, _ in points}
        if not points:
            return
        n = sum(w for _, _, w in points)
        mean_r = sum(r * w for r, _, w in points) / n
        mean_t = sum(t * w for _, t, w in points) / n
        spread = max(r for r, _, _ in points) - min(r for r, _, _ in points)
        if spread >= MIN_SPAN:
            var = sum(w * (r - mean_r) ** 2 for r, _, w in points)
            slope = sum(w * (r - mean_r) * (t - mean_t) for r, t, w in points) / var
            fixed = mean_t - slope * mean_r
            if slope >= 0 and fixed > 0:  # otherwise noise, or a curve a line does not fit here: keep the ratio
                self.fixed_ms, self.row_ms = fixed, slope
                return
        ratio = PRIOR_ROW_MS / PRIOR_FIXED_MS
        self.fixed_ms = mean_t / (1 + ratio * mean_r)
        self.row_ms = ratio * self.fixed_ms


def attended(position: int, tokens: int) -> float:
    """About how many (token, earlier token) pairs of its prompt a chunk of ``tokens`` fed at ``position`` attends
    to: what makes a token dearer the deeper into its prompt it sits."""
    return tokens * (position + tokens / 2)


def width(rows: Iterable[tuple[int, float]], cost: StepCost, share: float = 1.0, modelled: int = 0) -> int:
    """The micro-batch's width: how many tokens each row is fed (1: no drafts), its drafts to be cut to width - 1.

    ``rows``: each row's draft length and acceptance estimate. A row yields its token and the draft tokens it
    keeps; the micro-batch costs ``share`` of the step's fixed time (its part of it: 1 / micro-batches) and its
    B x W rows, and where a draft model proposes (``modelled``: the longest of its drafts here) its steps too,
    one per draft token up to W - 1, at ``cost.draft_step_ms`` each (``share`` of them: the model drafts for
    every micro-batch at once). The width with the most expected tokens per millisecond wins; the narrower on a
    tie, so that drafts nobody expects to keep cost nothing.
    """
    rows = list(rows)
    if not rows:
        return 1
    best, best_rate = 1, 0.0
    for w in range(1, 2 + min(MAX_K, max(d for d, _ in rows))):
        tokens = len(rows) + sum(expected_kept(min(d, w - 1), p) for d, p in rows)
        drafting = share * cost.draft_step_ms * min(modelled, w - 1)
        rate = tokens / (cost.ms(len(rows) * w, share) + drafting)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = w, rate
    return best
