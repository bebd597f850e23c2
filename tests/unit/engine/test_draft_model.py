"""Speculative decoding with a draft model (``--draft-model``), its decisions in-process: the rejection rule keeps
the target's distribution, checked against known distributions by a chi-square test; the proposer asks for k
tokens and learns from verified drafts only; the server's draft rate is the next sequence's prior; a draft whose
tokenizer maps a token elsewhere is told apart.

The served pairs (greedy output equal to decoding without drafts at TP=1, TP=2 and in a pipeline; sampled output
keeping its distribution): tests/e2e/speculation/test_draft_model.py.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx

from neuron.engine.drafts import MODEL_FLOOR, MODEL_PRIOR, DraftRate, Proposer
from neuron.engine.text import Text
from neuron.rank.head.rejection import Rejection
from neuron.rank.head.sampler import Sampler
from neuron.sampling_params import SamplingParams
from testkit import tokenizer_files
from testkit.drafting import chi_square_critical


def _goodness(counts: Counter[int], p: list[float]) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against the distribution ``p``, and its degrees of freedom."""
    n = sum(counts.values())
    cells = [i for i, pi in enumerate(p) if pi > 0]
    assert all(counts[i] == 0 for i in range(len(p)) if p[i] == 0), "a token the target never draws was drawn"
    return sum((counts[i] - n * p[i]) ** 2 / (n * p[i]) for i in cells), len(cells) - 1


# The rejection rule in-process: known target and draft distributions over a vocabulary of 6.
P = [0.4, 0.25, 0.2, 0.1, 0.05, 0.0]
Q = [0.05, 0.1, 0.15, 0.2, 0.3, 0.2]


def _first_tokens(trials: int) -> tuple[Counter[int], Counter[int], int]:
    """Each trial: a draft token drawn from Q, verified against P by ``Rejection``; the first token kept, the
    draft token itself, and how many drafts were kept."""
    logits = mx.log(mx.array([P, P]) + 1e-30)  # the draft's position and the bonus's: the same P
    q = mx.array([Q])
    kept, drafted, accepted = Counter[int](), Counter[int](), 0
    key = mx.random.key(7)
    for trial in range(trials):
        key, sub = mx.random.split(key)
        token = int(mx.random.categorical(mx.log(q[0]), key=sub).item())
        sampler = Sampler(SamplingParams(temperature=1.0, seed=trial))
        run = Rejection.draw(sampler, logits, [token], q)
        mx.eval(run.arrays())
        sampled = run.keep()
        kept[sampled.token] += 1
        drafted[token] += 1
        accepted += sampled.token == token and len(sampled.more) == 1
    return kept, drafted, accepted


def test_rejection_sampling_keeps_the_target_distribution_whatever_the_draft() -> None:
    kept, drafted, accepted = _first_tokens(3000)
    stat, df = _goodness(kept, P)
    assert stat < chi_square_critical(df), (stat, kept)
    # The test can fail: the draft's own tokens, Q-distributed, are far from P.
    assert _goodness(drafted - Counter({5: drafted[5]}), P)[0] > chi_square_critical(df)
    # And kept as often as the literature says: sum of min(p, q).
    rate = sum(min(p, q) for p, q in zip(P, Q, strict=True))
    assert abs(accepted / 3000 - rate) < 0.04, accepted


def test_a_model_proposer_asks_for_k_tokens_and_learns_from_verified_drafts_only() -> None:
    proposer = Proposer(limit=3, model=True)
    assert proposer.wanted(room=10) == 3 and proposer.wanted(room=2) == 2  # asked before the plan is made
    assert proposer.propose([1, 2], [3], room=10, proposed=[7, 8, 9, 10]) == [7, 8, 9]
    assert proposer.propose([1, 2], [3], room=2, proposed=[7, 8, 9]) == [7, 8]
    before = proposer.acceptance
    proposer.update(0, 0)  # cut whole by the batch's rule: nothing was drawn, nothing is learned
    proposer.propose([1, 2], [3, 4], room=10)
    assert proposer.acceptance == before
    for _ in range(3):  # misses in a row: it rests, as prompt lookup does
        proposer.propose([1, 2], [3], room=10, proposed=[7, 8, 9])
        proposer.update(3, 0)
    assert proposer.wanted(room=10) == 0 and proposer.propose([1, 2], [3], room=10, proposed=[7]) == []


def test_the_servers_draft_rate_is_the_next_sequences_prior_with_a_floor() -> None:
    shared = DraftRate()
    first = Proposer(lookup_rate=shared.prior(), model=True, shared=shared)
    first.propose([1], [2], room=10)
    first.update(4, 4)  # kept whole: the server's rate rises
    assert shared.prior() > MODEL_PRIOR
    for _ in range(40):  # a useless draft: nothing kept, over and over
        first.propose([1], [2], room=10)
        first.update(1, 0)
    assert shared.rate < MODEL_FLOOR and shared.prior() == MODEL_FLOOR


def test_a_tokenizer_that_maps_a_token_elsewhere_is_told_apart(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        tokenizer_files(tmp_path / name)
    same = Text.load(tmp_path / "a").differs(Text.load(tmp_path / "b"))
    assert same is None
    data = json.loads((tmp_path / "b" / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = list(vocab)[5:7]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(data))
    problem = Text.load(tmp_path / "a").differs(Text.load(tmp_path / "b"))
    assert problem is not None and "has id" in problem
