"""Stop strings: nothing of a stop string is ever released, however the text is cut into tokens."""

from __future__ import annotations

import pytest

from neuron.engine.sequence import StopText


def feed(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool]:
    text = StopText(stops)
    out = []
    for piece in pieces:
        released, stopped = text.push(piece)
        out.append(released)
        if stopped:
            return "".join(out), True
    return "".join(out) + text.flush(), False


@pytest.mark.parametrize("cut", range(1, 6))
def test_a_stop_split_anywhere_is_caught(cut: int) -> None:
    whole = "Hello\n\nUser: more"
    pieces = [whole[i : i + cut] for i in range(0, len(whole), cut)]
    assert feed(("\n\nUser:",), pieces) == ("Hello", True)


def test_the_earliest_stop_wins_and_a_false_start_is_released() -> None:
    assert feed(("END", "ab"), ["xa", "yE", "N", "Dab"]) == ("xay", True)
    assert feed(("END", "ab"), ["xa", "b", "END"]) == ("x", True)
    assert feed(("END",), ["E", "N", "x"]) == ("ENx", False)


def test_held_text_is_released_once_it_cannot_start_a_stop() -> None:
    text = StopText(("</s>",))
    assert text.push("a<") == ("a", False)
    assert text.push("/") == ("", False)
    assert text.push("b") == ("</b", False)
    assert text.push("<") == ("", False)
    assert text.flush() == "<"


def test_no_stops_releases_everything_at_once() -> None:
    text = StopText(("",))
    assert text.push("abc") == ("abc", False)


def test_no_stop_string_counts_before_it_is_armed() -> None:
    """vLLM's min_tokens: a stop string before the minimum is plain text, and nothing is held back for it."""
    text = StopText(("ab",))
    assert text.push("xab", armed=False) == ("xab", False)
    assert text.push("a", armed=False) == ("a", False)
    assert text.push("ab") == ("", True)
