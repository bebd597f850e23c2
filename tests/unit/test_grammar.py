"""Output constraints without a server: schemas llguidance refuses (and how fast), and rank 0's sampler masking
real logits, a dead end included, beside an unconstrained row of the same batch."""

from __future__ import annotations

import json
import time

import mlx.core as mx
import pytest

from neuron.engine.text import Text
from neuron.grammar import MAX_DEPTH, GrammarError, Grammars
from neuron.rank.head.sampler import Sampler, sample_all
from neuron.sampling_params import SamplingParams
from testkit import tokenizer_files


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Text:
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer_files(folder)  # the tiny models' tokenizer, without a model
    return Text.load(folder)


@pytest.fixture(scope="module")
def grammars(text: Text) -> Grammars:
    return Grammars(text.tokenizer._tokenizer, 259, sorted(text.eos_token_ids))


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "array", "contains": {"type": "string"}}, '"contains"'),  # names the keyword it lacks
        ({"type": "object", "if": {"type": "object"}}, '"if"'),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum (5) is greater than maximum (2)"),
        ({"type": "nope"}, "nope"),
        (_nested(1000), f"deeper than {MAX_DEPTH} levels"),
        ({"enum": [f"value {i}" for i in range(100_000)]}, "too big"),
        (LOOP, "no JSON value can begin to match it"),
        ({"$ref": "#"}, "no JSON value can begin to match it"),
    ],
    ids=["contains", "if", "bounds", "type", "deep", "huge-enum", "ref-loop", "self-ref"],
)
def test_what_cannot_be_enforced_is_refused_quickly_saying_why(grammars: Grammars, schema: dict, says: str) -> None:
    started = time.process_time()  # the work, which a loaded machine's wall clock would stretch
    with pytest.raises(GrammarError, match=None) as e:
        grammars.compile(schema)
    assert says in str(e.value)
    assert time.process_time() - started < 5.0


def test_a_recursive_schema_with_a_base_case_compiles(grammars: Grammars) -> None:
    tree = {
        "$defs": {
            "node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
        },
        "$ref": "#/$defs/node",
    }
    grammars.compile(tree)


def _greedy(text: Text, sampler: Sampler, steps: int, bias: int) -> str:
    """Greedy tokens from logits that favour ``bias`` above everything: only a mask keeps it out."""
    out = []
    for _ in range(steps):
        logits = mx.zeros((259,)).at[bias].add(100.0)
        sampled = sample_all({1: sampler}, {1: logits})[1]
        assert sampled.error is None
        if sampled.token in text.eos_token_ids:
            break
        out.append(sampled.token)
    return text.tokenizer.decode(out)


def test_the_mask_holds_the_output_to_the_schema_against_the_logits(text: Text, grammars: Grammars) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    z = text.encode("z")[0]
    out = _greedy(text, Sampler(SamplingParams(constraint=grammars.compile(schema))), 20, z)
    assert json.loads(out)["n"] in range(100)
    assert "z" in _greedy(text, Sampler(SamplingParams()), 3, z)  # without the mask, z wins


def test_a_dead_end_fails_its_row_only(text: Text, grammars: Grammars) -> None:
    """``{"a": <a $ref loop>}`` passes its first mask, then has no token to offer after ``{"a": ``."""
    trap = {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"], "$defs": LOOP["$defs"]}
    constrained = Sampler(SamplingParams(constraint=grammars.compile(trap)))
    free = Sampler(SamplingParams())
    failed = None
    for _ in range(20):
        sampled = sample_all({1: constrained, 2: free}, {1: mx.zeros((259,)), 2: mx.zeros((259,)).at[7].add(1.0)})
        assert sampled[2].token == 7 and sampled[2].error is None
        if (failed := sampled[1].error) is not None:
            break
    assert failed is not None and "constraint" in failed


def test_a_resumed_sampler_rewinds_its_constraint_to_the_tokens_it_produced(text: Text, grammars: Grammars) -> None:
    """After a lost group, the constraint may have followed a token of the step that failed: a resumed sampler
    (``Start.produced``) puts it back where the delivered tokens leave it."""
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}}, "required": ["word"]}
    params = SamplingParams(constraint=grammars.compile(schema))
    z = text.encode("z")[0]
    logits = mx.zeros((259,)).at[z].add(100.0)
    first = Sampler(params)
    produced = [sample_all({1: first}, {1: logits})[1].token for _ in range(4)]  # the 4th: in the step that failed
    resumed = Sampler(params, tuple(produced[:3]))
    out = text.tokenizer.decode(produced[:3]) + _greedy(text, resumed, 30, z)
    assert json.loads(out) == {"word": "zzzzzzzz"}, out


def test_a_parser_that_outgrows_its_limits_is_the_schemas_fault_and_answered_400() -> None:
    from neuron.engine.sequence import Failure
    from neuron.grammar import TOO_COMPLEX, _why
    from neuron.server.common.errors import failure_error

    limit = "Parser Error: Current row has 2211 items; max is 2000; consider making your grammar left-recursive"
    too_big = failure_error(Failure("constraint", _why(limit, "the output constraint refused token 93"), 3, 2))
    assert (too_big.status, too_big.code, too_big.param) == (400, "schema_too_complex", "response_format")
    assert too_big.message.startswith(TOO_COMPLEX)
    other = failure_error(
        Failure("constraint", _why("token not allowed", "the output constraint refused token 5"), 3, 2)
    )
    assert (other.status, other.code) == (500, "constraint_failed")
