"""Agent sessions hit the prefix cache: replayed through the official openai and anthropic clients against a real
``neuron serve`` (testkit.agents: a system prompt, tools, forced calls and their results, short replies, a date the
template writes, thinking that later turns drop). From the second turn on, at least 95% of each turn's reusable
prompt tokens (what a cache of everything computed before could serve) are served from the cache.

One server per model for the module: the plain agent model split into two pipeline stages (whose replies are saved
from every stage's own layers), and the thinking model on one rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit import Server, serving
from testkit.agents import SCRIPT, Session, make_agent_model, replay, share

SHARE = 0.95
# A reply turn's text: a few words, not testkit.agents' two sentences (its benchmark's), which are a decode step a
# byte each; what the cache must do with a reply (restore it as generated, or drop its thinking) needs no more.
REPLY = {
    "type": "object",
    "properties": {"status": {"enum": ["Found it: the check comes too late.", "Fixed; the tests pass."]}},
    "required": ["status"],
    "additionalProperties": False,
}
# ``</think>``'s logit bias in the OpenAI form's thinking turns: a thought of a few to some tens of tokens, where
# testkit.agents' default lets the tiny thinker think for most of a turn's 200 tokens; a thought of any length is
# written back without it.
THINK_BIAS = 11.0
TURNS = 5  # a user's task, two tool calls and their results, a reply, the user's next message
# The turns answered with text, each followed by another turn.
REPLIES = [i for i, (kind, _) in enumerate(SCRIPT[: TURNS - 1]) if kind in ("user", "reply")]


def _served(factory: pytest.TempPathFactory, name: str, *args: str) -> Iterator[Server]:
    model = make_agent_model(factory.mktemp("agent") / name, thinking=name == "thinker")
    with serving(factory, "--model", str(model), *args) as server:
        yield server


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _served(tmp_path_factory, "agent", "--pp", "2")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _served(tmp_path_factory, "thinker")


def _check(session: Session) -> None:
    for i, turn in enumerate(session.turns[1:], 1):
        assert turn.cached_tokens >= SHARE * turn.reusable, f"turn {i}: {turn}"
    assert share([session]) >= SHARE


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_an_agent_session_reuses_its_prompts_and_replies(plain: Server, api: str) -> None:
    session = replay(plain.url, Session(api, "agent", reply=REPLY), TURNS)
    _check(session)
    # A reply turn's text comes back in the next turn as it was generated: restored beyond the prompt before it.
    assert all(session.turns[i + 1].cached_tokens > session.turns[i].prompt_tokens for i in REPLIES)


def test_a_new_date_leaves_only_what_precedes_it_reusable(plain: Server) -> None:
    dates = ["30 Dec 1999"] * 4 + ["31 Dec 1999"]  # never today: other sessions wrote today's
    session = replay(plain.url, Session("openai", "agent", dates=dates, reply=REPLY), TURNS)
    _check(session)
    # The date is in the system header: a new one leaves only the tokens before it reusable.
    assert session.turns[4].reusable < 32 and session.turns[4].cached_tokens == session.turns[4].reusable


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_thinking_session_reuses_all_but_the_dropped_thinking(thinker: Server, api: str) -> None:
    session = replay(thinker.url, Session(api, "thinker", thinking=True, reply=REPLY, think_bias=THINK_BIAS), TURNS)
    _check(session)
    # The next turn writes a thinking reply back without its thinking: what was generated is not reusable.
    assert all(session.turns[i + 1].reusable < session.turns[i].prompt_tokens for i in REPLIES)
