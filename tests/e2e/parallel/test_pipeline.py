"""Pipeline parallelism: the model's layers in runs of whole layers, one run per rank, hidden states passed on.

Each multi-rank case runs in a fresh leader process (testkit/leader_scenarios.py),
as the pool tests do; the serving path is covered by tests/e2e/serving/test_batching.py's ``pp2``
server, and by tests/e2e/hosts/ across hosts.
"""

from __future__ import annotations

import itertools
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from neuron.launch.stages import SplitError, check_split, parse_split, split_by_memory
from neuron.models.folder import ModelError, weight_bytes
from neuron.rank.model.share import check_splittable
from testkit import make_tiny_model, run_neuron, run_neuron_side_by_side
from testkit.faults import FAKE_HOST_ENV
from testkit.scenarios import TP1_TOKENS, scenario, scenarios_side_by_side
from testkit.server import PARIS


@pytest.fixture(scope="module")
def staged(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> dict[tuple[str, int], Any]:
    """Each tiny model in the stages the session's cases of the test below ask for, in a fresh leader each (the
    ``generate`` scenario), two leaders side by side (a leader's start is mostly one process importing, so their
    starts overlap on the cores): each run's result, or the failure it raised, by model and stages."""
    wanted = [
        (item.callspec.params["arch"], item.callspec.params["stages"])  # type: ignore[attr-defined]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_pipeline_stages_give_tp1s_tokens_each_holding_its_share"
        and getattr(item, "module", None) is request.module
    ]

    def run(case: tuple[str, int]) -> Any:
        arch, stages = case
        try:
            return scenario("generate", str(tiny_models[arch]), stages, TP1_TOKENS, stages)
        except AssertionError as e:
            return e

    with ThreadPoolExecutor(2) as runs:
        return dict(zip(wanted, runs.map(run, wanted), strict=True))


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pipeline_stages_give_tp1s_tokens_each_holding_its_share(
    staged: dict[tuple[str, int], Any], tiny_tp1: dict[str, dict], arch: str, stages: int
) -> None:
    result = staged[arch, stages]
    if isinstance(result, AssertionError):
        raise result
    alone = tiny_tp1[arch]
    assert result["tokens"] == alone["tokens"] and result["after_reload"] == alone["tokens"]
    assert len(set(alone["tokens"])) > 8
    layers = result["layers"]
    assert [end - first for first, end in layers] and layers[0][0] == 0 and layers[-1][1] == 4
    assert all(a[1] == b[0] for a, b in itertools.pairwise(layers))  # contiguous, in rank order
    # Every parameter is held once: rank 0 the embedding (tied: also the head) and its layers, the rest theirs.
    assert sum(result["parameters"]) == alone["parameters"][0]
    assert max(result["parameters"][1:]) < alone["parameters"][0] / 2


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_the_other_architectures_neuron_stages_give_tp1s_tokens(tmp_path: Path, arch: str) -> None:
    """qwen2's mlx-lm file has a pipeline of its own (unused here), mistral is llama's code under another name."""
    model = str(make_tiny_model(tmp_path / arch, arch))
    alone, staged = scenarios_side_by_side(("generate", model, 1, 24), ("generate", model, 2, 24, 2))
    assert len(set(alone["tokens"])) > 8
    assert staged["tokens"] == alone["tokens"]


def test_an_uneven_split_and_one_by_free_memory_give_the_same_tokens(
    tiny_models: dict[str, Path], tiny_tp1: dict[str, dict]
) -> None:
    model = str(tiny_models["qwen3"])
    per_layer, rest = weight_bytes(model, 4)
    # Rank 1's host has three times rank 0's room for layers (rank 0 also holds the embedding).
    room = 2 * per_layer[0]
    fake = f"0:free_memory={room + rest};1:free_memory={3 * room}"
    with ThreadPoolExecutor(2) as runs:  # side by side
        uneven = runs.submit(scenario, "generate", model, 2, TP1_TOKENS, 2, [1, 3])
        weighted = runs.submit(scenario, "generate", model, 2, TP1_TOKENS, 2, env={FAKE_HOST_ENV: fake})
    assert uneven.result()["layers"] == [[0, 1], [1, 4]] and uneven.result()["tokens"] == tiny_tp1["qwen3"]["tokens"]
    assert weighted.result()["layers"] == [[0, 1], [1, 4]]
    assert weighted.result()["tokens"] == tiny_tp1["qwen3"]["tokens"]


def test_smollm2_in_three_stages_and_split_unevenly_answers_as_one_rank(
    smollm2_paris: subprocess.CompletedProcess[str],
) -> None:
    alone = smollm2_paris  # one rank
    assert "Paris" in alone.stdout, alone.stdout
    splits = (("--pp", "3"), ("--pp", "2", "--pp-layers", "5,25"))
    for split, staged in zip(splits, run_neuron_side_by_side(*(("generate", *PARIS, *s) for s in splits)), strict=True):
        assert staged.returncode == 0, staged.stderr[-2000:]
        assert staged.stdout == alone.stdout, split


def test_seeded_sampling_in_stages_equals_one_rank(tiny_models: dict[str, Path]) -> None:
    """A stage runs whole layers in the same order as one rank does, so the logits, and what a seed draws from
    them, are the same."""
    sample = ("generate", "--model", str(tiny_models["qwen3"]), "--max-tokens", "24", "--temperature", "1.0")
    stages = ("2", "3")
    alone, other_seed, *staged = run_neuron_side_by_side(
        (*sample, "--seed", "7", "hello"),
        (*sample, "--seed", "8", "hello"),
        *((*sample, "--seed", "7", "--pp", n, "hello") for n in stages),
    )
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert other_seed.stdout != alone.stdout  # the seed decides: it is sampling
    for n, done in zip(stages, staged, strict=True):
        assert done.returncode == 0 and done.stdout == alone.stdout, (n, done.stderr[-2000:])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tp", "2", "--pp", "2"), "needs sub-groups of the ranks"),
        (("--pp", "2", "--pp-layers", "1,1,2"), "must name 2 stages whose layers add up to the model's 4"),
        (("--pp", "2", "--pp-layers", "a,b"), "--pp-layers must be layer counts"),
        (("--pp-layers", "2,2"), "give --pp too"),
        (("--pp", "5"), "4 layers, fewer than the 5 pipeline stages"),
    ],
)
def test_splits_that_cannot_be_are_refused_before_anything_loads(
    tiny_models: dict[str, Path], args: tuple[str, ...], message: str
) -> None:
    done = run_neuron("generate", "--model", str(tiny_models["llama"]), *args, "hello", timeout=60)
    assert done.returncode in (1, 2) and message in done.stderr, done.stderr[-2000:]


def test_micro_batches_without_stages_are_refused(tiny_models: dict[str, Path]) -> None:
    done = run_neuron("serve", "--model", str(tiny_models["llama"]), "--micro-batches", "2", "--port", "0", timeout=60)
    assert done.returncode == 2 and "--micro-batches overlaps pipeline stages: give --pp too" in done.stderr


def test_an_architecture_neuron_cannot_stage_is_named() -> None:
    config = {"model_type": "gemma", "num_hidden_layers": 4, "vocab_size": 10, "hidden_size": 8}
    with pytest.raises(ModelError, match=r"split .gemma. into pipeline stages .*serve it with --tp instead of --pp"):
        check_splittable(config, 2, 2)


def test_layers_go_where_the_memory_is() -> None:
    per_layer, rest = [10] * 30, 50
    assert split_by_memory(per_layer, rest, [350, 300]) == [15, 15]  # rank 0's 50 bytes of head set aside
    assert split_by_memory(per_layer, rest, [200, 300]) == [10, 20]
    crowded = split_by_memory(per_layer, rest, [50, 100, 100])
    assert crowded[0] == 1 and sorted(crowded[1:]) == [14, 15]  # no room left on rank 0: still one layer
    counts = split_by_memory([10] * 7, 0, [1, 1, 1])
    assert sorted(counts) == [2, 2, 3] and sum(counts) == 7  # the remainder goes by largest share left over
    assert parse_split("10,20") == [10, 20]
    with pytest.raises(SplitError):
        check_split([10, 20], 31, 2)
