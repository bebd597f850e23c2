"""Speculative decoding without a draft model: prompt lookup and ``prediction`` drafts, verified in the batch.

Speculation must be lossless: every test compares a request with drafts against the same request with
``num_draft_tokens: 0`` on the same server (no drafts), alone and concurrent, at TP=1, TP=2 and in a pipeline.
Greedy runs with and without drafts are compared by ``closeness.assert_same``: exactly on the CPU; on a GPU a
difference only at a near tie (a draft widens the batch, which changes the kernels' reduction order). The
proposer's decisions: tests/unit/engine/test_speculate.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from testkit import Server, serving
from testkit.closeness import NEAR_TIE, TOP, Scored, assert_all_same, assert_same, exact

# Repetitive prompts: prompt lookup finds drafts in them, and the tiny models repeat themselves too.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "one two three four one two three four one two three four one two",
    "hello",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
]
MAX_TOKENS = [40, 33, 25, 47]


def _complete(server: Server, prompt: str, max_tokens: int, **extra: object) -> dict:
    body = {"model": "qwen3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


async def _together(server: Server, **extra: object) -> list[dict]:
    out: list[dict] = [{}] * len(PROMPTS)

    async def one(i: int) -> None:
        out[i] = await anyio.to_thread.run_sync(lambda: _complete(server, PROMPTS[i], MAX_TOKENS[i], **extra))

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return out


def _scored(replies: list[dict]) -> list[Scored]:
    return [Scored.of(r["choices"][0]) for r in replies]


@pytest.mark.anyio
async def test_greedy_is_identical_with_and_without_drafts_alone_and_concurrent(split_qwen3: Server) -> None:
    scored = {"logprobs": TOP}
    plain = [
        _complete(split_qwen3, p, n, num_draft_tokens=0, **scored) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)
    ]
    alone = [_complete(split_qwen3, p, n, **scored) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    together = await _together(split_qwen3, **scored)
    assert_all_same(_scored(plain), _scored(alone), "drafted alone, prompt")
    assert_all_same(_scored(plain), _scored(together), "drafted together, prompt")
    if exact():  # past a near tie a GPU's run may end elsewhere
        assert [r["usage"]["completion_tokens"] for r in alone] == [r["usage"]["completion_tokens"] for r in plain]
    accepted = sum(r["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] for r in alone)
    assert accepted > 0  # drafts were really verified and kept
    assert all(r["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0 for r in plain)


@pytest.mark.anyio
async def test_stop_strings_and_max_tokens_landing_inside_kept_drafts(split_qwen3: Server) -> None:
    prompt = PROMPTS[1]
    whole = _complete(split_qwen3, prompt, 40, num_draft_tokens=0)["choices"][0]["text"]
    for max_tokens in (1, 2, 5, 9, 14):
        plain = _complete(split_qwen3, prompt, max_tokens, num_draft_tokens=0, logprobs=TOP)
        drafted = _complete(split_qwen3, prompt, max_tokens, logprobs=TOP)
        assert_same(Scored.of(plain["choices"][0]), Scored.of(drafted["choices"][0]), f"max_tokens {max_tokens}")
        assert drafted["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] <= max_tokens
    for start in (3, 8, 15, 22):
        stop = whole[start : start + 3]
        plain = _complete(split_qwen3, prompt, 40, num_draft_tokens=0, stop=[stop])["choices"][0]
        drafted = _complete(split_qwen3, prompt, 40, stop=[stop])["choices"][0]
        assert (drafted["text"], drafted["finish_reason"]) == (plain["text"], plain["finish_reason"])
        assert drafted["finish_reason"] == "stop" and stop not in drafted["text"]


@pytest.mark.anyio
async def test_logprobs_of_kept_tokens_equal_plain_decoding(split_qwen3: Server) -> None:
    plain = _complete(split_qwen3, PROMPTS[0], 30, num_draft_tokens=0, logprobs=3)
    drafted = _complete(split_qwen3, PROMPTS[0], 30, logprobs=3)
    assert drafted["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    assert_same(Scored.of(plain["choices"][0]), Scored.of(drafted["choices"][0]))
    a, b = plain["choices"][0]["logprobs"], drafted["choices"][0]["logprobs"]
    pairs = zip(a["tokens"], b["tokens"], strict=False)
    flipped = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a["tokens"]), len(b["tokens"])))
    # Up to where a GPU's near tie flipped (nowhere, on the CPU): a verified token's logprob is plain decoding's.
    tolerance = 1e-4 if exact() else NEAR_TIE
    assert a["token_logprobs"][:flipped] == pytest.approx(b["token_logprobs"][:flipped], abs=tolerance)


@pytest.mark.anyio
async def test_seeded_sampling_draws_the_same_tokens_with_and_without_drafts(split_qwen3: Server) -> None:
    # The verifier samples every position with the request's own key, split once per kept token: the draws
    # are those of plain decoding, so the target distribution holds exactly (and seeded output is unchanged).
    for seed in (1, 2, 3):
        extra = {"temperature": 0.8, "seed": seed, "top_p": 0.95}
        plain = _complete(split_qwen3, PROMPTS[1], 40, num_draft_tokens=0, **extra)
        drafted = _complete(split_qwen3, PROMPTS[1], 40, **extra)
        assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]


@pytest.fixture(scope="module")
def small(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real model: the tiny ones' random text does not survive detokenizing and tokenizing again."""
    with serving(tmp_path_factory, "--model", str(smollm2)) as server:
        yield server


def test_a_right_prediction_is_mostly_kept_and_a_wrong_one_changes_nothing(small: Server, smollm2: Path) -> None:
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    body = {"model": smollm2.name, "messages": messages, "max_tokens": 64, "temperature": 0.0}

    def chat(**extra: object) -> dict:
        response = httpx.post(f"{small.url}/v1/chat/completions", json={**body, **extra}, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    before = small.metrics()
    # The wrong prediction first, on a server that has timed no step yet: the cost rule weighs its drafts by the
    # prior step-time model, which lets them be fed. Later, the times measured decide, and on a loaded machine a
    # wide step timed slow can keep a wrong prediction from ever being proposed, which would prove nothing.
    wrong = chat(prediction={"type": "content", "content": "Lorem ipsum dolor sit amet, " * 8})
    assert wrong["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] > 0
    text = chat(num_draft_tokens=0)["choices"][0]["message"]["content"]
    assert wrong["choices"][0]["message"]["content"] == text
    predicted = chat(prediction={"type": "content", "content": text})
    assert predicted["choices"][0]["message"]["content"] == text
    details, completion = predicted["usage"]["completion_tokens_details"], predicted["usage"]["completion_tokens"]
    accepted = details["accepted_prediction_tokens"]
    verify_steps = completion - 1 - accepted  # the first token comes from the prompt; each step keeps its run + 1
    assert accepted / verify_steps >= 3, (details, completion)
    after = small.metrics()
    kept = ("neuron_speculative_accepted_tokens_total", ())
    assert after[kept] - before.get(kept, 0) >= accepted
    assert after[("neuron_speculative_proposed_tokens_total", ())] > after[kept]
    done = [e for e in small.logs() if e.get("event") == "decode done"]
    assert done[-1]["accepted_tokens"] == accepted and done[-1]["proposed_tokens"] >= accepted


def test_a_linear_attention_batch_drops_different_tails_as_if_fed_only_what_it_kept() -> None:
    """A tiny Qwen3-Next's batch (gated delta states and key/value layers) fed a 4-token verify step, each row then
    dropping a different tail (``rank.kv.states``, ``drop_tail``), computes the next step as each row alone would have,
    fed one token at a time only what it kept; also where a row leaves and another joins between the two steps."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    from neuron.rank.kv import caches, states
    from neuron.rank.kv.rollback import drop_tail
    from testkit.tiny_archs import config

    cfg = config("qwen3_next", 64)
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(5)
    model = model_class(args_class.from_dict(cfg))
    states.hook(model)
    prompts = mx.random.randint(0, 64, (4, 6))
    fed = mx.random.randint(0, 64, (4, 4))
    after = mx.random.randint(0, 64, (4, 1))
    own = [caches.fresh(model) for _ in range(4)]
    for row, cache in enumerate(own):
        model(prompts[row : row + 1], cache=cache)

    def alone(row: int, kept: int) -> mx.array:
        cache = caches.fresh(model)
        model(prompts[row : row + 1], cache=cache)
        for t in range(kept):
            model(fed[row : row + 1, t : t + 1], cache=cache)
        return model(after[row : row + 1], cache=cache)[0, -1]

    # (rows verified together, the row that leaves after, each staying row's drop): row 3 joins after, dropping none
    for rows, leaving, drops in (([0, 1, 2], None, [0, 2, 3]), ([0, 1, 2], 1, [3, 0])):
        batch = caches.merge([caches.copied(own[row]) for row in rows])
        states.record_each_position(batch, True)
        model(fed[mx.array(rows)], cache=batch)
        states.stop_recording(batch)
        staying = [i for i, row in enumerate(rows) if row != leaving]
        for layer in batch:
            layer.filter(staying)
        for layer, joining in zip(batch, caches.merge([caches.copied(own[3])]), strict=True):
            layer.extend(joining)
        drop_tail(batch, [*drops, 0])
        states.record_each_position(batch, False)
        now = [rows[i] for i in staying] + [3]
        ours = model(after[mx.array(now)], cache=batch)[:, -1]
        for i, row in enumerate(now):
            expected = alone(row, 4 - drops[i]) if row != 3 else alone(3, 0)
            assert mx.allclose(ours[i], expected, atol=1e-4).item(), (row, mx.abs(ours[i] - expected).max())
