"""The prefix cache end to end: the same greedy tokens with it on and off, what it reports, its budget, and a
rank whose cache went its own way caught as a desync.

Each configuration runs two real servers side by side, one with the cache off (the reference) and one with it
on; tests/unit/engine/test_prefix.py checks the index's decisions directly. "The same tokens" is
``testkit.closeness.assert_same``'s: exactly on the CPU; on a GPU a difference only at a near tie (a restored prefix
changes the prefill's shapes).
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import anyio
import httpx
import openai
import pytest
from openai.types.responses import ResponseUsage

from testkit import Server, faults, serving, serving_side_by_side
from testkit.closeness import TOP, Scored, assert_same

# About 1,000 tokens for the tiny models' byte-level tokenizer (one token a byte).
SYSTEM = "".join(f"Rule {i}: answer in the voice of a lighthouse keeper. " for i in range(20))[:1000]
QUESTIONS = ["hi", "What is rope?", "Count to ten.", "Why is the sea salty?", "zz", "Tell a joke.", "Sum 2+2", "Bye"]
TURNS = ["Hello there.", "Tell me more.", "And then?", "Thanks, that is all."]


def _client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


Turn = tuple[Scored, int, int]  # the reply, its prompt tokens, its cached tokens


async def _chat(server: Server, model: str, messages: list[dict[str, str]], max_tokens: int) -> Turn:
    """The reply with its logprobs, its prompt tokens and its cached tokens."""
    async with _client(server) as client:
        reply = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=True,
            top_logprobs=TOP,
        )
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return Scored.of(reply.choices[0].model_dump()), usage.prompt_tokens, cached


async def conversation(server: Server, model: str, system: str, max_tokens: int = 12) -> list[Turn]:
    """Four turns of one chat, each resending the whole conversation."""
    messages = [{"role": "system", "content": system}]
    turns = []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        turns.append(await _chat(server, model, messages, max_tokens))
        messages.append({"role": "assistant", "content": turns[-1][0].text})
    return turns


async def concurrent(
    server: Server, model: str, system: str, max_tokens: int = 10, count: int = len(QUESTIONS)
) -> list[Turn]:
    """The first ``count`` questions at once, sharing one long system prompt."""
    asked = QUESTIONS[:count]
    out: list[Turn] = [(Scored(""), 0, 0)] * len(asked)

    async def one(i: int) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": asked[i]}]
        out[i] = await _chat(server, model, messages, max_tokens)

    async with anyio.create_task_group() as tg:
        for i in range(len(asked)):
            tg.start_soon(one, i)
    return out


T = TypeVar("T")


async def side_by_side(off: Awaitable[T], on: Awaitable[T]) -> tuple[T, T]:
    """Both servers asked at once: each answers its own requests in the order it would alone, and one's waits
    (a collective, a reply) leave the cores to the other."""
    out: dict[str, T] = {}

    async def run(name: str, call: Awaitable[T]) -> None:
        out[name] = await call

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "off", off)
        tg.start_soon(run, "on", on)
    return out["off"], out["on"]


def check_conversation(off: list[Turn], on: list[Turn]) -> None:
    for i, (reference, turn) in enumerate(zip(off, on, strict=True)):
        assert_same(reference[0], turn[0], f"turn {i}")
        if turn[0].tokens != reference[0].tokens:
            break  # a near tie flipped (on a GPU only): the later turns' prompts differ
    assert [t[2] for t in off] == [0, 0, 0, 0]
    # Every turn after the first restores the whole previous prompt (a prefix of this one), and the reply's tokens
    # as far as the template writes them back as they were generated.
    assert on[0][2] == 0 and all(t[2] >= previous[1] for t, previous in zip(on[1:], on, strict=False)), on


def check_concurrent(off: list[Turn], on: list[Turn], shared: int) -> None:
    for i, (reference, request) in enumerate(zip(off, on, strict=True)):
        assert_same(reference[0], request[0], f"request {i}")
    assert all(t[2] == 0 for t in off)
    # The first two start before any prompt is saved; the others find the system prompt cached.
    assert sum(t[2] >= shared for t in on) >= len(on) - 2, on


@pytest.fixture(scope="module", params=[("llama", "1"), ("qwen3", "2")], ids=["tp1", "tp2"])
def pair(
    request: pytest.FixtureRequest, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Server, Server]]:
    model, tp = request.param
    args = ("--model", str(tiny_models[model]), "--tp", tp)
    with serving_side_by_side(tmp_path_factory, (*args, "--prefix-cache-bytes", "0"), args) as (off, on):
        yield model, off, on


@pytest.mark.anyio
async def test_a_four_turn_chat_is_unchanged_and_each_turn_reuses_the_last(pair: tuple[str, Server, Server]) -> None:
    model, off, on = pair
    reference, turns = await side_by_side(conversation(off, model, "Be brief."), conversation(on, model, "Be brief."))
    check_conversation(reference, turns)
    assert on.find_log("prefill done", prompt_tokens=turns[3][1], cached_tokens=turns[3][2]) is not None


@pytest.mark.anyio
async def test_eight_concurrent_requests_sharing_a_system_prompt_are_unchanged(
    pair: tuple[str, Server, Server],
) -> None:
    model, off, on = pair
    check_concurrent(*await side_by_side(concurrent(off, model, SYSTEM), concurrent(on, model, SYSTEM)), len(SYSTEM))
    metrics = on.metrics()
    assert metrics[("neuron_prefix_cache_hits_total", ())] >= 6
    assert metrics[("neuron_prefix_cache_cached_tokens_total", ())] >= 6 * len(SYSTEM)
    assert metrics[("neuron_prefix_cache_bytes", ())] > 0
    assert off.metrics()[("neuron_prefix_cache_hits_total", ())] == 0


@pytest.mark.anyio
async def test_responses_usage_counts_the_prompt_tokens_written_to_the_cache_and_those_read(
    pair: tuple[str, Server, Server],
) -> None:
    """OpenAI's Responses usage requires ``cache_write_tokens`` beside ``cached_tokens`` (its published spec, which
    the SDK's ``ResponseUsage`` is generated from, and validated here): the first request writes its prompt, the
    same one again reads all of it it can and writes nothing; with the cache off, neither."""
    model, off, on = pair
    question = "Which lamp burns longest at the top of the tower?"

    async def usage(server: Server) -> ResponseUsage:
        async with _client(server) as client:
            reply = await client.responses.create(model=model, input=question, max_output_tokens=4, temperature=0.0)
        assert reply.usage is not None
        return ResponseUsage.model_validate(reply.usage.model_dump())  # every field OpenAI's spec requires

    first, again = await usage(on), await usage(on)
    # The module's other tests may have left entries that share the template's first tokens.
    cached = first.input_tokens_details.cached_tokens
    assert 0 < first.input_tokens_details.cache_write_tokens == first.input_tokens - cached
    assert cached < again.input_tokens_details.cached_tokens < again.input_tokens  # the last token is computed
    assert again.input_tokens_details.cache_write_tokens == 0
    for alone in (await usage(off), await usage(off)):
        assert alone.input_tokens_details.cached_tokens == alone.input_tokens_details.cache_write_tokens == 0


def _complete(server: Server, prompt: str) -> dict:
    body = {"model": "llama", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": TOP}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_tiny_budget_evicts_the_oldest_entry_and_changes_no_output(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The tiny llama's KV cache costs 4,096 bytes a token: room for one 300-byte prompt, not two. Each completion
    # leaves its prompt and the 7 of its 8 tokens it was fed (the last is sampled, never fed) as one entry.
    budget = str(400 * 4096)
    kept = 307 * 4096
    a, b = "A" * 299 + "a", "B" * 299 + "b"
    with serving(tmp_path_factory, "--model", str(tiny_models["llama"]), "--prefix-cache-bytes", budget) as server:
        first_a = _complete(server, a)
        assert server.metrics()[("neuron_prefix_cache_bytes", ())] == kept
        assert _complete(server, a + "!")["usage"]["prompt_tokens_details"]["cached_tokens"] == 300
        first_b = _complete(server, b)  # needs the room a's entries hold: they go, the oldest first
        metrics = server.metrics()
        # a's prompt (covered by a and its reply), a and its reply, a + "!" and its reply, b's prompt (covered)
        assert metrics[("neuron_prefix_cache_evictions_total", ())] == 4
        assert metrics[("neuron_prefix_cache_bytes", ())] == kept
        again_a = _complete(server, a)
        assert again_a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # gone: computed afresh
        assert_same(Scored.of(first_a["choices"][0]), Scored.of(again_a["choices"][0]), "a, computed again")
        assert _complete(server, "C" * 2000)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert server.metrics()[("neuron_prefix_cache_bytes", ())] == kept  # too large to keep: nothing flushed
        assert_same(Scored.of(first_b["choices"][0]), Scored.of(_complete(server, b)["choices"][0]), "b, again")


def test_a_rank_that_loses_an_entry_is_a_desync_naming_it_and_the_next_request_succeeds(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    prompt = "The keeper climbs the stairs at dusk."
    # Step 1 is the probe; step 2 feeds the first request's prompt and saves it, then rank 1 drops the entry.
    env = {faults.DROP_ENTRY_ENV: "1:2"}
    with serving(
        tmp_path_factory, "--model", str(tiny_models["qwen3"]), "--tp", "2", env=env, module=faults.ENTRY
    ) as server:
        body = {"model": "qwen3", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "logprobs": TOP}
        failed = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert failed.status_code == 500
        assert "rank 1" in failed.json()["error"]["message"] and "desync" in failed.json()["error"]["message"]
        assert server.metrics()[("neuron_desyncs_total", ())] == 1
        # Every rank's entries and the leader's index were cleared together: a miss, then a hit, both served.
        retried = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert retried.status_code == 200, retried.text
        assert retried.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        hit = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        assert_same(Scored.of(retried.json()["choices"][0]), Scored.of(hit["choices"][0]), "restored")


@pytest.mark.anyio
async def test_a_second_request_sharing_1500_tokens_reports_them_cached(pair: tuple[str, Server, Server]) -> None:
    model, _, on = pair
    prefix = "".join(f"Entry {i} of the keeper's log: the lamp is lit and the sea is calm. " for i in range(30))[:1500]
    first = await _chat(on, model, [{"role": "user", "content": prefix + " First question?"}], 2)
    second = await _chat(on, model, [{"role": "user", "content": prefix + " Second one?"}], 2)
    assert first[2] < 20 and second[2] >= 1400, (first, second)  # the first shares only the template's opening


def test_smollm2_over_three_ranks_equals_one_rank_and_is_unchanged_by_the_cache(
    smollm2: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The real model, whose norms and weights catch a wrong position or a stale row that random tiny models can
    hide: a four-turn chat and four concurrent requests sharing a system prompt, the same token for token with
    the cache on (over three ranks) and off (on one rank). The system prompt is about 120 tokens, not the tiny
    models' 1,000: three ranks on two cores compute about 60 prompt tokens a second, and the reference computes
    all four prompts whole; a restored prefix read at a wrong position or from a stale row changes the next
    token whatever its length.

    The same two servers hold SmolLM2 split in three (nine heads, three key/value heads) to one rank's tokens, as
    tests/e2e/serving/test_cli.py's TP=3 run did, which started the same two loads a second time: the first turn and the
    first concurrent prompts are computed with nothing cached, and a wrong split changes their first token (as it
    changes every later one). The command line's own path over several ranks is held to one rank's by test_cli's
    tiny TP=2 runs."""
    model, args = smollm2.name, ("--model", str(smollm2))
    system = " ".join(f"Rule {i}: answer briefly and kindly." for i in range(12))
    # The reference without the cache runs on one rank: a second three-rank server on two cores would double this
    # test's minutes, and where nothing is cached the two must agree anyway. The three ranks feed 128 prompt
    # tokens a step, about one prompt: the first two start before either is saved and the other two find it, as
    # the tiny models' 1,000 tokens do at the default 512 (which would feed four of these prompts at once).
    # Two tokens a turn: the second is decoded over the restored prefix. One token for the concurrent prompts: it
    # is the one a restored prefix decides, and with no sequence left decoding the scheduler feeds every cached
    # prompt in one step rather than a few tokens a step (three ranks on two cores take a second or more a step).
    commands = ((*args, "--prefix-cache-bytes", "0"), (*args, "--tp", "3", "--prefill-chunk", "128"))
    with serving_side_by_side(tmp_path_factory, *commands) as (off, on):

        async def asked(server: Server) -> tuple[list[Turn], list[Turn]]:
            return await conversation(server, model, "Be brief.", 2), await concurrent(server, model, system, 1, 4)

        (off_turns, off_many), (on_turns, on_many) = anyio.run(side_by_side, asked(off), asked(on))
        check_conversation(off_turns, on_turns)
        assert on_many[0][1] >= 120
        check_concurrent(off_many, on_many, on_many[0][1] - 20)
