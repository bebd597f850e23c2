"""Speculative decoding with a draft model (``--draft-model``): the draft proposes, the target verifies.

The pairs are built: a tiny target whose layers after the first are damped (their output projections scaled down),
and a draft cut from its first layer, so that the draft agrees with it often but not always; with the damping at 0,
the target computes what its first layer computes and every draft is kept. Greedy output must equal decoding
without drafts (``num_draft_tokens: 0`` on the same server) at TP=1, TP=2 and in a pipeline, alone and batched,
with penalties; a constrained row decodes without drafts. Sampled output must keep the target's distribution:
the rejection rule is checked against known distributions in-process, and served samples with and without the
draft are compared by a chi-square test.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from closeness import TOP, Scored, assert_all_same
from conftest import SPLITS, Server, run_neuron, serving
from drafting import complete, drafts_change_nothing, spoken

from neuron.engine.drafts import MODEL_FLOOR, MODEL_PRIOR, DraftRate, Proposer
from neuron.engine.text import Text
from neuron.rank.head.rejection import Rejection
from neuron.rank.head.sampler import Sampler
from neuron.sampling_params import SamplingParams
from testkit import cut_layers, make_tiny_model, quiet_layers, tokenizer_files

PROMPTS = ["hello", "one two three four one two", "The quick brown fox jumps", "def add(a, b):\n"]
MAX_TOKENS = [30, 41, 25, 36]


def _pair(root: Path, damping: float, layers: int = 4) -> tuple[Path, Path]:
    target = quiet_layers(make_tiny_model(root / "target", "qwen3", layers=layers), 1, damping)
    return target, cut_layers(target, root / "draft", 1)


def _critical(df: int, z: float = 3.09) -> float:
    """The chi-square statistic a test at p = 0.001 rejects above (Wilson and Hilferty's approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _goodness(counts: Counter[int], p: list[float]) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against the distribution ``p``, and its degrees of freedom."""
    n = sum(counts.values())
    cells = [i for i, pi in enumerate(p) if pi > 0]
    assert all(counts[i] == 0 for i in range(len(p)) if p[i] == 0), "a token the target never draws was drawn"
    return sum((counts[i] - n * p[i]) ** 2 / (n * p[i]) for i in cells), len(cells) - 1


def _homogeneity(a: Counter[str], b: Counter[str]) -> tuple[float, int]:
    """Pearson's statistic of two samples drawn from one distribution (a 2 x k table), and its degrees of freedom.
    Outcomes seen under 5 times in both together share one cell, so that no expected count is tiny."""
    na, nb = sum(a.values()), sum(b.values())
    rare = {k for k in a.keys() | b.keys() if a[k] + b[k] < 5}
    cells = [(a[k], b[k]) for k in a.keys() | b.keys() if k not in rare]
    if rare:
        cells.append((sum(a[k] for k in rare), sum(b[k] for k in rare)))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for seen, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (seen - expected) ** 2 / expected
    return stat, len(cells) - 1


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


@pytest.mark.unit
def test_rejection_sampling_keeps_the_target_distribution_whatever_the_draft() -> None:
    kept, drafted, accepted = _first_tokens(3000)
    stat, df = _goodness(kept, P)
    assert stat < _critical(df), (stat, kept)
    # The test can fail: the draft's own tokens, Q-distributed, are far from P.
    assert _goodness(drafted - Counter({5: drafted[5]}), P)[0] > _critical(df)
    # And kept as often as the literature says: sum of min(p, q).
    rate = sum(min(p, q) for p, q in zip(P, Q, strict=True))
    assert abs(accepted / 3000 - rate) < 0.04, accepted


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


# Served: one server per split, shared by the module's tests.


@pytest.fixture(scope="module")
def damped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _pair(tmp_path_factory.mktemp("damped"), 0.1)


@pytest.fixture(scope="module", params=list(SPLITS.values()), ids=list(SPLITS))
def drafted(
    request: pytest.FixtureRequest, damped: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    target, draft = damped
    args = ("--model", str(target), "--draft-model", str(draft), "--prefill-chunk", "16", *request.param)
    with serving(tmp_path_factory, *args) as server:
        yield server


def _complete(server: Server, prompt: str, max_tokens: int, **extra: object) -> dict:
    return complete(server, "target", prompt, max_tokens, **extra)


@pytest.mark.anyio
async def test_greedy_with_a_draft_model_is_decoding_without_one(drafted: Server) -> None:
    await drafts_change_nothing(drafted, "target", PROMPTS, MAX_TOKENS)


def test_penalties_and_stops_with_a_draft_model(drafted: Server) -> None:
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4, "logprobs": TOP}
    for prompt, n in zip(PROMPTS[:2], MAX_TOKENS[:2], strict=True):
        plain = _complete(drafted, prompt, n, num_draft_tokens=0, **penalties)
        with_draft = _complete(drafted, prompt, n, **penalties)
        assert_all_same([Scored.of(plain["choices"][0])], [Scored.of(with_draft["choices"][0])], "penalties")
    whole = _complete(drafted, PROMPTS[1], 30, num_draft_tokens=0)["choices"][0]["text"]
    for max_tokens in (1, 2, 7):
        plain, with_draft = (_complete(drafted, PROMPTS[1], max_tokens, num_draft_tokens=d) for d in (0, None))
        assert with_draft["choices"][0]["text"] == plain["choices"][0]["text"]
        assert with_draft["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] <= max_tokens
    stop = whole[9:12]
    plain, with_draft = (_complete(drafted, PROMPTS[1], 30, num_draft_tokens=d, stop=[stop]) for d in (0, None))
    assert with_draft["choices"][0]["text"] == plain["choices"][0]["text"]
    assert with_draft["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"] == "stop"


def test_a_constrained_row_decodes_without_drafts(drafted: Server) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {
        "model": "target",
        "messages": [{"role": "user", "content": "JSON please"}],
        "max_tokens": 30,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
    }
    replies = []
    for extra in ({"num_draft_tokens": 0}, {}):
        response = httpx.post(f"{drafted.url}/v1/chat/completions", json={**body, **extra}, timeout=120)
        assert response.status_code == 200, response.text
        replies.append(response.json())
    assert replies[1]["choices"][0]["message"] == replies[0]["choices"][0]["message"]
    assert spoken(replies) == (0, 0)


def _samples(server: Server, drafts: bool, requests: int) -> tuple[Counter[str], tuple[int, int]]:
    """``requests`` seeded samples of 3 tokens (top-2 at temperature 1), counted by their text. One at a time:
    the batch's rule prices the draft's own steps, and drafting pays most at batch 1."""
    out: Counter[str] = Counter()
    replies = []
    for i in range(requests):
        extra = {} if drafts else {"num_draft_tokens": 0}
        body = {"temperature": 1.0, "top_k": 2, "seed": 1000 + i + (0 if drafts else 500_000), **extra}
        reply = _complete(server, "hello", 3, **body)
        replies.append(reply)
        out.update(choice["text"] for choice in reply["choices"])
    return out, spoken(replies)


def test_sampled_output_follows_the_same_distribution_with_and_without_the_draft(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The distribution is the verifier's, on rank 0: one rank shows it. The target is deep and its draft one
    layer, so that the batch's rule, which prices the draft's steps against the target's, finds drafting worth it
    whatever the machine's load (with the module's shallow pair a draft step costs nearly a target step)."""
    target, draft = _pair(tmp_path_factory.mktemp("deep"), 0.05, layers=16)
    with serving(tmp_path_factory, "--model", str(target), "--draft-model", str(draft)) as server:
        with_draft, (kept, thrown) = _samples(server, True, 120)
        without, _ = _samples(server, False, 120)
    assert kept > 0 and thrown > 0, (kept, thrown)  # both of the rule's branches were taken
    stat, df = _homogeneity(with_draft, without)
    assert df >= 2 and stat < _critical(df), (stat, df, with_draft, without)


@pytest.fixture(scope="module")
def exact_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _pair(tmp_path_factory.mktemp("exact"), 0.0)


def test_a_draft_the_target_agrees_with_is_kept_whole(
    exact_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    target, draft = exact_pair
    with serving(tmp_path_factory, "--model", str(target), "--draft-model", str(draft), "--tp", "2") as server:
        plain = _complete(server, PROMPTS[0], 40, num_draft_tokens=0)
        with_draft = _complete(server, PROMPTS[0], 40)
    assert with_draft["choices"][0]["text"] == plain["choices"][0]["text"]
    kept, thrown = spoken([with_draft])
    assert thrown == 0 and kept >= 30, (kept, thrown)


def test_a_draft_model_with_another_tokenizer_is_refused_at_start(
    exact_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    target, draft = exact_pair
    other = Path(shutil.copytree(draft, tmp_path / "other"))
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = list(vocab)[40:42]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(data))
    done = run_neuron("serve", "--model", str(target), "--draft-model", str(other), "--port", "0", timeout=120)
    assert done.returncode != 0
    assert "--draft-model" in done.stderr and "tokenizer is not the model's" in done.stderr, done.stderr[-2000:]
