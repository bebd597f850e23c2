"""Speculative decoding with a draft model (``--draft-model``): the draft proposes, the target verifies.

The pairs are built: a tiny target whose layers after the first are damped (their output projections scaled down),
and a draft cut from its first layer, so that the draft agrees with it often but not always; with the damping at 0,
the target computes what its first layer computes and every draft is kept. Greedy output must equal decoding
without drafts (``num_draft_tokens: 0`` on the same server) at TP=1, TP=2 and in a pipeline, alone and batched,
with penalties; a constrained row decodes without drafts. Sampled output must keep the target's distribution:
served samples with and without the draft are compared by a chi-square test (the rejection rule itself, against
known distributions in-process: tests/unit/engine/test_draft_model.py).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit import Server, cut_layers, make_tiny_model, quiet_layers, run_neuron, serving
from testkit.closeness import TOP, Scored, assert_all_same
from testkit.drafting import chi_square_critical, complete, drafts_change_nothing, spoken
from testkit.server import SPLITS

PROMPTS = ["hello", "one two three four one two", "The quick brown fox jumps", "def add(a, b):\n"]
MAX_TOKENS = [30, 41, 25, 36]


def _pair(root: Path, damping: float, layers: int = 4) -> tuple[Path, Path]:
    target = quiet_layers(make_tiny_model(root / "target", "qwen3", layers=layers), 1, damping)
    return target, cut_layers(target, root / "draft", 1)


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
    assert df >= 2 and stat < chi_square_critical(df), (stat, df, with_draft, without)


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
