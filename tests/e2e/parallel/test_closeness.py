"""The rule the equality tests compare by (``testkit/closeness.py``): exact on the CPU, up to a near tie on a GPU."""

from __future__ import annotations

import pytest

from testkit.closeness import NEAR_TIE, Scored, assert_same, difference, exact

REFERENCE = Scored(
    " a b c",
    [" a", " b", " c"],
    [{" a": -0.1, " x": -3.0}, {" b": -0.70, " y": -0.70 - NEAR_TIE / 2, " z": -2.0}, {" c": -0.2}],
)


def _other(*tokens: str) -> Scored:
    return Scored("".join(tokens), list(tokens), [{t: -1.0} for t in tokens])


def test_a_flip_is_accepted_only_at_a_near_tie_in_the_reference() -> None:
    assert difference(REFERENCE, _other(" a", " b", " c")) is None
    assert difference(REFERENCE, _other(" a", " y", " q")) is None  # a near tie flipped; after it, anything
    far = difference(REFERENCE, _other(" a", " z", " c"))
    assert far is not None and far.startswith("token 1: ' z' for ' b'") and "apart in log-probability" in far
    unseen = difference(REFERENCE, _other(" x", " b", " c"))  # -0.1 against -3.0: no tie
    assert unseen is not None and unseen.startswith("token 0:")
    outside = difference(REFERENCE, _other(" a", " w", " c"))
    assert outside is not None and "not both among the reference's top" in outside
    shorter = difference(REFERENCE, _other(" a", " b"))
    assert shorter is not None and "2 of them against the reference's 3" in shorter
    assert difference(REFERENCE, Scored(" a b C", REFERENCE.tokens, REFERENCE.top)) is not None


def test_the_cpu_asks_for_every_token() -> None:
    near_tie = _other(" a", " y", " c")
    if not exact():
        assert_same(REFERENCE, near_tie)
        return
    with pytest.raises(AssertionError, match="' a y c' != ' a b c'"):
        assert_same(REFERENCE, near_tie, "run")
    assert_same(REFERENCE, Scored(" a b c", [" a", " b", " c"], []))


def test_completions_chat_and_streamed_choices_are_read() -> None:
    completion = {
        "text": " a b",
        "logprobs": {"tokens": [" a", " b"], "top_logprobs": [{" a": -0.1}, {" b": -0.2, " c": -0.3}]},
    }
    assert Scored.of(completion) == Scored(" a b", [" a", " b"], [{" a": -0.1}, {" b": -0.2, " c": -0.3}])
    chat = {
        "message": {"content": "hi"},
        "logprobs": {"content": [{"token": "hi", "logprob": -0.5, "top_logprobs": [{"token": "hi", "logprob": -0.5}]}]},
    }
    assert Scored.of(chat) == Scored("hi", ["hi"], [{"hi": -0.5}])
    pieces = [Scored.of(completion, streamed=True), Scored.of({"text": "!", "logprobs": None}, streamed=True)]
    assert Scored.joined(pieces) == Scored(" a b!", [" a", " b"], completion["logprobs"]["top_logprobs"])
    with pytest.raises(AssertionError, match="ask for logprobs"):
        Scored.of({"text": " a", "logprobs": None})
