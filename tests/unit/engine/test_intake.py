"""A request becoming sequences (``engine.intake``): each refusal names its field, and each choice starts with
what it should. The model's tokenizer, no model; tests/e2e/serving/test_server.py and test_openai_extras.py show
the same through a real server.
"""

from __future__ import annotations

import pytest

from neuron.engine.drafts import MAX_K
from neuron.engine.intake import Intake
from neuron.engine.refusals import RequestError
from neuron.engine.scheduler import Scheduling
from neuron.engine.text import Text
from neuron.grammar import Grammars
from neuron.sampling_params import SamplingParams
from testkit import tokenizer_files

CONTEXT = 64
VOCAB = 259
EOS = frozenset({2})


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Text:
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer_files(folder)
    return Text.load(folder)


def intake(text: Text, **limits: object) -> Intake:
    return Intake(Scheduling(**limits), CONTEXT, VOCAB, EOS, text.tokenizer)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prompt", "params", "n", "param", "says"),
    [
        ([], SamplingParams(), 1, "prompt", "the prompt is empty"),
        ([5, VOCAB], SamplingParams(), 1, "prompt", f"token ids must lie in [0, {VOCAB})"),
        ([-1], SamplingParams(), 1, "prompt", "token ids must lie in"),
        ([5] * CONTEXT, SamplingParams(), 1, "prompt", f"the prompt has {CONTEXT} tokens but the context holds"),
        ([5], SamplingParams(temperature=3.0), 1, "temperature", "temperature"),
        ([5], SamplingParams(logit_bias={VOCAB: 1.0}), 1, "logit_bias", "outside the vocabulary"),
        ([5], SamplingParams(stop_token_ids=(VOCAB,)), 1, "stop_token_ids", "outside the vocabulary"),
        ([5], SamplingParams(max_tokens=2, min_tokens=3), 1, "min_tokens", "at most max_tokens (2)"),
        ([5], SamplingParams(), 9, "n", "n must lie in [1, 8] on this server (--max-n), got 9"),
        ([5], SamplingParams(), 0, "n", "n must lie in [1, 8]"),
    ],
    ids=[
        "empty",
        "past the vocabulary",
        "negative id",
        "fills the context",
        "temperature",
        "logit_bias",
        "stop_token_ids",
        "min over max",
        "n over max_n",
        "n zero",
    ],
)
def test_a_refusal_names_its_field(
    text: Text, prompt: list[int], params: SamplingParams, n: int, param: str, says: str
) -> None:
    with pytest.raises(RequestError) as caught:
        intake(text).sequences(prompt, params, "r", n)
    assert caught.value.param == param and says in str(caught.value), (caught.value.param, str(caught.value))


def test_n_is_capped_by_the_batch_too(text: Text) -> None:
    with pytest.raises(RequestError, match=r"n must lie in \[1, 2\]"):
        intake(text, max_batch=2).sequences([5], SamplingParams(), "r", 3)


def test_choices_share_the_prompt_and_draw_their_own_seeds(text: Text) -> None:
    first, *copies = intake(text).sequences([5, 6], SamplingParams(seed=2**63 - 1, stop=("x",)), "r", 3)
    assert [s.params.seed for s in (first, *copies)] == [2**63 - 1, 0, 1]  # seed + i, wrapped into 63 bits
    assert first.copies == copies and all(c.copy_of is first for c in copies)
    assert len({s.no for s in (first, *copies)}) == 3  # each its own sequence in the plans
    assert all(s.prompt == [5, 6] and s.prompt is not first.prompt for s in copies)
    unseeded = intake(text).sequences([5], SamplingParams(), "r", 2)
    assert [s.params.seed for s in unseeded] == [None, None]


def test_end_of_sequence_ids_stop_unless_ignored(text: Text) -> None:
    (seq,) = intake(text).sequences([5], SamplingParams(stop_token_ids=(7,)), "r", 1)
    assert seq.params.stop_token_ids == (7, 2)
    (ignoring,) = intake(text).sequences([5], SamplingParams(stop_token_ids=(7,), ignore_eos=True), "r", 1)
    assert ignoring.params.stop_token_ids == (7,)


def test_max_tokens_is_capped_by_what_the_context_leaves(text: Text) -> None:
    (asked,) = intake(text).sequences([5] * 10, SamplingParams(max_tokens=20), "r", 1)
    (capped,) = intake(text).sequences([5] * 60, SamplingParams(max_tokens=20), "r", 1)
    (unasked,) = intake(text).sequences([5] * 10, SamplingParams(), "r", 1)
    assert (asked.max_tokens, capped.max_tokens, unasked.max_tokens) == (20, CONTEXT - 60, CONTEXT - 10)


def test_max_tokens_is_capped_by_the_servers_max_completion_tokens_too(text: Text) -> None:
    limited = intake(text, max_completion_tokens=4)
    (asked,) = limited.sequences([5] * 10, SamplingParams(max_tokens=20), "r", 1)
    (unasked,) = limited.sequences([5] * 10, SamplingParams(), "r", 1)
    (fewer,) = limited.sequences([5] * 10, SamplingParams(max_tokens=2), "r", 1)
    (squeezed,) = limited.sequences([5] * 62, SamplingParams(), "r", 1)
    assert (asked.max_tokens, unasked.max_tokens, fewer.max_tokens, squeezed.max_tokens) == (4, 4, 2, CONTEXT - 62)


def test_who_speculates_and_from_what(text: Text) -> None:
    (plain,) = intake(text).sequences([5], SamplingParams(), "r", 1)
    assert plain.proposer is not None and plain.proposer.k <= MAX_K
    (predicted,) = intake(text).sequences([5], SamplingParams(prediction="hi", num_draft_tokens=2), "r", 1)
    assert predicted.proposer is not None and predicted.proposer.prediction == text.encode("hi")
    assert predicted.proposer.limit == 2
    grammars = Grammars(text.tokenizer._tokenizer, VOCAB, sorted(EOS))
    constrained = SamplingParams(constraint=grammars.compile({"type": "integer"}))
    refused = [
        intake(text, speculate="off").sequences([5], SamplingParams(), "r", 1)[0],
        intake(text).sequences([5], SamplingParams(num_draft_tokens=0), "r", 1)[0],
        intake(text).sequences([5], constrained, "r", 1)[0],
    ]
    assert [s.proposer for s in refused] == [None, None, None]
