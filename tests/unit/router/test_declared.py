"""The models a router serves, as declared (``router.declared``): each table's own settings checked at start and
named by its entry, names that clash refused, keep_alive in seconds or Ollama's words."""

from __future__ import annotations

import pytest

from neuron.router.declared import Declared, conflicts, duration, from_flags, from_tables


def test_repeated_model_flags_name_each_model_by_its_folder() -> None:
    declared = from_flags(["/models/qwen3", "/models/llama.gguf"], preload=True, keep_alive=30.0)
    assert [(d.name, d.preload, d.keep_alive) for d in declared] == [("qwen3", True, 30.0), ("llama", True, 30.0)]


def test_a_table_carries_its_own_split_adapters_and_residency() -> None:
    tables = [
        {"model": "/m/qwen3", "tp": 2, "preload": True},
        {"model": "/m/llama", "name": "small", "pp": 2, "adapter": ["fr=/a/fr", "de=/a/de"], "keep_alive": "5m"},
    ]
    declared, problems = from_tables(tables, "neuron.toml", keep_alive=None)
    assert problems == []
    assert declared[0] == Declared("qwen3", "/m/qwen3", (("tp", 2),), True, None)
    assert declared[1].name == "small" and dict(declared[1].own) == {"pp": 2, "adapter": "fr=/a/fr,de=/a/de"}
    assert declared[1].keep_alive == 300.0 and declared[1].adapters() == ["fr", "de"]


def test_every_problem_in_the_tables_is_named_by_its_entry() -> None:
    tables = [{"model": "/m/a", "tp": 0, "colour": "red"}, {"tp": 2}, {"model": "/m/b", "keep_alive": "soon"}]
    _, problems = from_tables(tables, "neuron.toml", keep_alive=None)
    text = "\n".join(problems)
    assert "tp of [[models]] entry 1 in neuron.toml must be at least 1" in text
    assert "[[models]] entry 1 in neuron.toml has unknown keys colour" in text
    assert "[[models]] entry 2 in neuron.toml needs model = SOURCE" in text
    assert "keep_alive of [[models]] entry 3 in neuron.toml" in text
    assert from_tables({"model": "/m/a"}, "neuron.toml", None)[1] == [
        "models in neuron.toml must be [[models]] tables, each with model = SOURCE"
    ]


def test_a_name_claimed_twice_is_refused_naming_both_sources() -> None:
    same = [Declared("qwen3", "/a/qwen3"), Declared("qwen3", "/b/qwen3")]
    assert conflicts(same) == [
        "the model name 'qwen3' is declared more than once (/a/qwen3, /b/qwen3); give each [[models]] entry a name "
        "of its own (name = ...)"
    ]
    adapter = [Declared("fr", "/a/fr"), Declared("base", "/a/base", (("adapter", "fr=/x"),))]
    assert len(conflicts(adapter)) == 1


@pytest.mark.parametrize(
    ("given", "seconds"), [(30, 30.0), (1.5, 1.5), ("5m", 300.0), ("30s", 30.0), ("1h", 3600.0), ("250ms", 0.25),
                           (-1, None), ("-1", None)],
)  # fmt: skip
def test_keep_alive_reads_seconds_and_ollamas_durations(given: object, seconds: float | None) -> None:
    assert duration(given, "keep_alive") == (seconds, None)


def test_a_keep_alive_that_is_no_duration_says_what_is() -> None:
    _, problem = duration("later", "keep_alive")
    assert problem == "keep_alive must be seconds or a duration such as \"5m\" (ms, s, m, h), got 'later'"
    assert duration(True, "keep_alive")[1] is not None
