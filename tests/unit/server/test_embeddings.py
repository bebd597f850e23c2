"""/v1/embeddings, the decisions checked directly: the request, the model's pooling and sizes, the scheduler's
plans for embedding inputs. The official ``openai`` client against served models, whose vectors must equal
mlx-lm's own: tests/e2e/embeddings/test_embeddings.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neuron.engine.intake import Intake
from neuron.engine.refusals import RequestError
from neuron.engine.scheduler import Scheduling
from neuron.engine.sequence import Sequence, StopText
from neuron.models.folder import Embedding, card_pooling, embedding
from neuron.sampling_params import SamplingParams
from neuron.server import embeddings
from neuron.server.common.errors import ApiError
from neuron.step import NOT_ASKED, Sampled
from testkit.scheduling import admitted, request, run, scheduler


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("one text", ["one text"]),
        (["a", "b c"], ["a", "b c"]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5], [6, 7]], [[5], [6, 7]]),
    ],
    ids=["string", "strings", "token ids", "lists of token ids"],
)
def test_the_four_shapes_of_input_are_read_in_order(given: Any, inputs: list[Any]) -> None:
    asked = embeddings.parse({"model": "m", "input": given}, "m")
    assert asked.inputs == inputs
    assert (asked.encoding_format, asked.dimensions, asked.truncate, asked.add_special_tokens) == (
        "float",
        None,
        None,
        True,
    )


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"input": "hi"}, 400, "model", "`model` is required"),
        ({"model": "other", "input": "hi"}, 404, "model", "does not exist"),
        ({"model": "m"}, 400, "input", "`input` is required"),
        ({"model": "m", "input": ""}, 400, "input", "is empty"),
        ({"model": "m", "input": ["a", ""]}, 400, "input[1]", "is empty"),
        ({"model": "m", "input": []}, 400, "input", "must be a string or an array of token ids"),
        ({"model": "m", "input": [[1], []]}, 400, "input[1]", "must be a string or an array of token ids"),
        ({"model": "m", "input": ["a"] * 2049}, 400, "input", "at most 2048 inputs"),
        ({"model": "m", "input": "a", "encoding_format": "int8"}, 400, "encoding_format", "float, base64"),
        ({"model": "m", "input": "a", "dimensions": 0}, 400, "dimensions", "at least 1"),
        ({"model": "m", "input": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "or -1"),
        ({"model": "m", "input": "a", "add_special_tokens": 1}, 400, "add_special_tokens", "a boolean"),
        ({"model": "m", "input": "a", "normalize": False}, 400, "normalize", "unrecognized request argument"),
        ({"model": "m", "input": "a", "user": {}}, 400, "user", "must be a string"),
    ],
)
def test_a_bad_request_names_its_field(body: dict[str, Any], status: int, param: str, words: str) -> None:
    with pytest.raises(ApiError) as refused:
        embeddings.parse(body, "m")
    assert (refused.value.status, refused.value.param) == (status, param)
    assert words in refused.value.message


def test_dimensions_cut_only_a_model_trained_for_it() -> None:
    def check(dimensions: int, model: Embedding) -> None:
        embeddings.check_dimensions(embeddings.EmbeddingRequest(["a"], dimensions=dimensions), model, "m")

    plain = Embedding("MEAN", 256)
    check(256, plain)  # its own size asks for nothing
    with pytest.raises(ApiError, match=r'Model "m" does not support matryoshka representation.*send `dimensions` 256'):
        check(64, plain)
    with pytest.raises(ApiError, match="at most 256"):
        check(512, Embedding("MEAN", 256, None))
    check(7, Embedding("MEAN", 256, None))  # is_matryoshka: any size
    listed = Embedding("MEAN", 256, (64, 128))
    check(128, listed)
    with pytest.raises(ApiError, match="only supports 64, 128, 256 matryoshka dimensions"):
        check(100, listed)


def test_a_cut_vector_is_of_unit_length_again() -> None:
    full = np.array([0.6, 0.0, 0.8], dtype="<f4").tobytes()
    assert embeddings.vector(full, None).tolist() == pytest.approx([0.6, 0.0, 0.8])
    assert embeddings.vector(full, 2).tolist() == [1.0, 0.0]


def test_truncate_prompt_tokens_keeps_each_inputs_last_tokens_within_the_context() -> None:
    ids = list(range(10, 30))
    asked = embeddings.EmbeddingRequest([ids, [1, 2]], truncate=5)
    assert embeddings.prompts(asked, None, 100) == [ids[-5:], [1, 2]]
    whole = embeddings.EmbeddingRequest([ids], truncate=-1)
    assert embeddings.prompts(whole, None, 8) == [ids[-8:]]
    with pytest.raises(ApiError, match=r"\(50\) is more than the context holds \(8\)"):
        embeddings.prompts(embeddings.EmbeddingRequest([ids], truncate=50), None, 8)


def test_an_input_longer_than_the_context_is_refused_naming_it_and_the_limit() -> None:
    intake = Intake(Scheduling(), context_length=8, vocab_size=100, eos_token_ids=frozenset({2}), tokenizer=None)
    first, second = intake.embeddings([[5] * 8, [6] * 3], "MEAN", "r")  # the whole context is allowed
    assert first.group == [second] and (first.pooling, second.max_tokens) == ("MEAN", 0)
    with pytest.raises(RequestError, match=r"`input\[1\]` has 9 tokens but this model embeds at most 8") as refused:
        intake.embeddings([[5], [6] * 9], "MEAN", "r")
    assert (refused.value.param, refused.value.code) == ("input[1]", "context_length_exceeded")
    with pytest.raises(RequestError, match=r"`input`: token ids must lie in \[0, 100\)"):
        intake.embeddings([[100]], "MEAN", "r")
    with pytest.raises(RequestError, match="holds no input"):
        intake.embeddings([], "MEAN", "r")


def _card(folder: Path, **modes: bool) -> Path:
    folder.mkdir()
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}]
    modules.append({"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **modes}))
    return folder


def test_the_pooling_is_the_settings_else_the_model_cards_else_the_mean(tmp_path: Path) -> None:
    last = _card(tmp_path / "qwen3-embedding", pooling_mode_lasttoken=True, pooling_mode_mean_tokens=False)
    mean = _card(tmp_path / "mean", pooling_mode_mean_tokens=True)
    cls = _card(tmp_path / "cls", pooling_mode_cls_token=True)  # no decoder is trained for it: not read
    assert (card_pooling(last), card_pooling(mean), card_pooling(cls), card_pooling(tmp_path)) == (
        "LAST",
        "MEAN",
        None,
        None,
    )
    config = {"hidden_size": 8}
    assert embedding(last, config, None) == Embedding("LAST", 8, ())
    assert embedding(last, config, "MEAN").pooling == "MEAN"
    assert embedding(tmp_path, config, None).pooling == "MEAN"
    assert embedding(tmp_path, {**config, "is_matryoshka": True}, None).cuts is None
    assert embedding(tmp_path, {**config, "matryoshka_dimensions": [2, 4]}, None).cuts == (2, 4)


def test_whole_inputs_are_batched_by_length_so_that_padding_never_outweighs_the_tokens() -> None:
    from neuron.rank.embed import _groups
    from neuron.rpc import Prefill

    def chunk(seq: int, length: int, pool: str = "MEAN") -> Prefill:
        return Prefill(seq, 0, [5] * length, True, pool=pool)

    def lengths(groups: list[list[Prefill]]) -> list[list[int]]:
        return [[len(c.tokens) for c in group] for group in groups]

    assert lengths(_groups([chunk(i, 12) for i in range(8)])) == [[12] * 8]
    assert lengths(_groups([chunk(1, 500), *(chunk(i, 10 + i) for i in range(2, 6))])) == [[12, 13, 14, 15], [500]]
    assert lengths(_groups([chunk(1, 3), chunk(2, 4, "LAST"), chunk(3, 5)])) == [[4], [3, 5]]
    assert _groups([]) == []


def _inputs(*lengths: int) -> list[Sequence]:
    seqs = []
    for length in lengths:
        no = 1000 + len(seqs) + 10 * length
        seq = Sequence("e", no, list(range(3, 3 + length)), 0, SamplingParams(), StopText(()))
        seq.pooling = "LAST"
        seqs.append(seq)
    seqs[0].group = seqs[1:]
    return seqs


def _vector(no: int) -> Sampled:
    return Sampled(0, NOT_ASKED, embedding=np.array([float(no)], dtype="<f4").tobytes())


def test_an_embedding_request_passes_a_generation_waiting_for_a_place_and_feeds_within_the_budget() -> None:
    s = scheduler(max_batch=1, prefill_chunk=8)
    running = request(3)
    admitted(s, running)
    run(s)  # its prompt is fed: it decodes from now on
    waiting = request(2)
    short, long = _inputs(3, 12)
    s.queues.add(waiting)
    s.queues.add(short)
    turn = s.schedule()
    assert turn.admitted == [short, long] and list(s.waiting) == [waiting]
    step = turn.step
    assert step is not None and set(step.starts) == set()  # no sampler for an input
    plan = step.plan
    assert [(c.seq, c.position, len(c.tokens), c.last, c.pool) for c in plan.prefill] == [
        (short.no, 0, 3, True, "LAST"),
        (long.no, 0, 5, False, "LAST"),
    ]
    assert [row.seq for row in plan.decode] == [running.no]  # the generation decodes in the same step
    delivered = s.update(step, {running.no: Sampled(7, NOT_ASKED), short.no: _vector(short.no)}, 1.0)
    assert [(d.seq, d.finish, d.sampled.embedding) for d in delivered if d.seq is short] == [
        (short, "stop", _vector(short.no).embedding)
    ]
    plan = run(s)
    assert plan.leave == [] and [(c.seq, c.position, c.last) for c in plan.prefill] == [(long.no, 5, True)]
    assert s.filling == [] and s.running == [running] and plan.save == []


def test_an_input_cancelled_half_fed_leaves_every_rank_in_the_next_plan() -> None:
    s = scheduler(prefill_chunk=4)
    (seq,) = _inputs(10)
    s.queues.add(seq)
    run(s)
    s.queues.cancel(seq)
    turn = s.schedule()
    assert [dropped for dropped, _ in turn.cancelled] == [seq]
    assert turn.step is None and turn.clear  # alone: one clear drops it on every rank


def test_a_failure_reaches_every_input_of_a_queued_request() -> None:
    s = scheduler(max_batch=1)
    first, second = _inputs(2, 2)
    s.queues.add(first)
    assert s.queues.clear() == [first, second]
