"""The architectures neuron serves: the table every check reads (the docs' copy is written from it as they build),
and each architecture's tiny model served by the engine, token for token as mlx-lm generates on the same weights.

Every architecture's model is generated once per session (``arch_models``). At one rank the engine runs in this
process; groups of ranks (TP=2, PP=2) run in a leader process per group, which serves each architecture in turn
with fresh workers (testkit/arch_checks.py). The table's split decisions alone: tests/unit/models/
test_architectures.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from neuron.models import architectures
from neuron.models.folder import ModelError
from neuron.rank.model.share import check_splittable
from testkit import ROOT, run_neuron
from testkit.arch_checks import PROMPTS, reference, serve
from testkit.tiny_archs import ARCHS, config, make_arch_model


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: make_arch_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def references(arch_models: dict[str, Path]) -> dict[str, dict[str, list]]:
    return {}  # filled on first use: mlx-lm's tokens cost a model load each


def _reference(arch: str, arch_models: dict[str, Path], references: dict[str, dict[str, list]]) -> dict[str, list]:
    if arch not in references:
        references[arch] = reference(str(arch_models[arch]))
        assert len({t for tokens in references[arch]["prompts"] for t in tokens}) > 8  # the tokens say something
    return references[arch]


def _check(result: dict, expected: dict[str, list], arch: str) -> None:
    assert result["alone"] == expected["prompts"], "alone"
    assert result["together"] == expected["prompts"], "four concurrent requests"
    assert result["copies"] == [expected["prompts"][1]] * 2, "n=2 copies"
    assert result["extended"] == expected["extended"], "a prompt extending a served one"
    assert result["next_turn"] == expected["next_turn"], "a chat's next turn"
    support = architectures.supports(config(arch, 300))
    assert support is not None
    # Both restored their whole previous prompt, whatever the caches: a snapshot at a prompt's end restores there.
    # Where the caches can be cut, each reply was kept with its prompt too: the next turn restores through it.
    reply = len(expected["prompts"][3])
    if support.cuttable:
        assert result["cached"] >= len(PROMPTS[2]), "the extending prompt restored the served one"
        assert len(PROMPTS[3]) < result["next_turn_cached"] <= len(PROMPTS[3]) + reply, "the next turn: its reply"
    else:
        assert result["cached"] == len(PROMPTS[2]), "the extending prompt restored the served one"
        assert result["next_turn_cached"] == len(PROMPTS[3]), "the next turn restored the previous one"
    assert result["hits"] == 2, "/metrics counts the two hits"
    if support.speculation:  # the predictions were drafted and verified, not ignored
        assert result["speculate"] == "ngram" and result["drafted"] > 0 and result["proposed"] > 0
    else:  # turned off
        assert result["speculate"] == "off" and result["drafted"] == 0 and result["proposed"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_one_rank_serves_every_architecture_as_mlx_lm_generates(
    arch: str, arch_models: dict[str, Path], references: dict[str, dict[str, list]]
) -> None:
    result = anyio.run(serve, str(arch_models[arch]))
    _check(result, _reference(arch, arch_models, references), arch)


SPLIT = [a for a in ARCHS if architectures.supports(config(a, 300)).tp]  # type: ignore[union-attr]
STAGED = [a for a in ARCHS if architectures.supports(config(a, 300)).pp]  # type: ignore[union-attr]
# llama and qwen3 are split in tests/e2e/parallel/test_pool.py and tests/e2e/serving/test_batching.py; qwen3_moe and
# glm4_moe by mlx-lm as they are.
TENSOR_PARALLEL = [a for a in SPLIT if a not in ("llama", "qwen3", "qwen3_moe", "glm4_moe")]
PIPELINED = [a for a in STAGED if a not in ("llama", "qwen3", "glm4_moe")]
# windowed_mistral's second stage holds one full-attention layer alone: its caches could all be cut, and yet it must
# feed new prompts as the first stage does (one by one), or the stages' passes differ. gemma4's is left to the
# leader, which moves the split by memory to keep its last layer with layer 1.
STAGE_SPLIT = {"windowed_mistral": "3,1", "qwen3_next": "1,3", "gemma3_text": "1,3"}
GROUPS = {"tp2": (2, 1), "pp2": (2, 2)}  # world size, stages
GROUP_TESTS = {
    "test_two_tensor_parallel_ranks_serve_as_mlx_lm_generates": "tp2",
    "test_two_pipeline_stages_serve_as_mlx_lm_generates": "pp2",
}


@pytest.fixture(scope="module")
def in_a_group(request: pytest.FixtureRequest, arch_models: dict[str, Path]) -> dict[str, dict[str, dict]]:
    """What each architecture the session's group tests ask for gave, by group and architecture: one leader
    process per group serves them in turn, each with fresh workers (a process per model would repeat the leader's
    start, the larger part of a tiny model's run); the two leaders run side by side."""
    wanted: dict[str, list[str]] = {name: [] for name in GROUPS}
    for item in request.session.items:
        name = GROUP_TESTS.get(getattr(item, "originalname", ""))
        if name is not None and getattr(item, "module", None) is request.module:
            wanted[name].append(item.callspec.params["arch"])  # type: ignore[attr-defined]
    folder = arch_models[ARCHS[0]].parent
    running = {}
    for name, archs in wanted.items():
        if not archs:
            continue
        split = {a: STAGE_SPLIT.get(a, "") if name == "pp2" else "" for a in archs}
        models = [f"{arch_models[a]}={split[a]}" for a in archs]
        out, err = (folder / f"{name}.out").open("w+"), (folder / f"{name}.err").open("w+")
        script = [sys.executable, "-m", "testkit.arch_checks", *map(str, GROUPS[name]), *models]  # from ROOT
        running[name] = (subprocess.Popen(script, stdout=out, stderr=err, text=True, cwd=ROOT), out, err)
    results: dict[str, dict[str, dict]] = {}
    for name, (process, out, err) in running.items():
        try:
            process.wait(timeout=120 * len(wanted[name]))
        finally:
            process.kill()  # where the wait ran out; nothing once it exited
            process.wait()
        out.seek(0)
        err.seek(0)
        said = err.read()[-4000:]
        by_model = {Path(line["model"]).name: line for line in map(json.loads, out.read().splitlines())}
        # The leader's exit counts for every model it served: one that crashes on its way out fails them all.
        results[name] = {
            arch: {"error": f"the leader exited with {process.returncode}: {said}"}
            if process.returncode
            else by_model.get(arch, {"error": f"no line for {arch}; the leader said: {said}"})
            for arch in wanted[name]
        }
    return results


def _served(in_a_group: dict[str, dict[str, dict]], group: str, arch: str) -> dict:
    served = in_a_group[group][arch]
    assert "error" not in served, served["error"]
    return served["result"]


@pytest.mark.parametrize("arch", TENSOR_PARALLEL)
def test_two_tensor_parallel_ranks_serve_as_mlx_lm_generates(
    arch: str,
    in_a_group: dict[str, dict[str, dict]],
    arch_models: dict[str, Path],
    references: dict[str, dict[str, list]],
) -> None:
    _check(_served(in_a_group, "tp2", arch), _reference(arch, arch_models, references), arch)


@pytest.mark.parametrize("arch", PIPELINED)
def test_two_pipeline_stages_serve_as_mlx_lm_generates(
    arch: str,
    in_a_group: dict[str, dict[str, dict]],
    arch_models: dict[str, Path],
    references: dict[str, dict[str, list]],
) -> None:
    _check(_served(in_a_group, "pp2", arch), _reference(arch, arch_models, references), arch)


@pytest.mark.parametrize(
    ("arch", "world_size", "stages", "message"),
    [
        ("granite", 3, 1, "'granite' has 4 attention heads, which do not divide over 3 ranks; use --tp with one of"),
    ],
)
def test_refusals_name_the_architecture_and_what_to_use_before_anything_loads(
    arch: str, world_size: int, stages: int, message: str
) -> None:
    with pytest.raises(ModelError, match=r"use|serve it") as caught:
        check_splittable(config(arch, 300), world_size, stages)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--pp", "2", "--pp-layers", "2,2"), "puts layer 3 in stage 1 and layer 1, whose keys and values it reads"),
        (("--pp", "3"), "no split into 3 stages puts each pair in one stage; use a smaller --pp"),
    ],
)
def test_a_gemma4_split_that_parts_a_reading_layer_from_its_source_is_refused_before_anything_loads(
    arch_models: dict[str, Path], args: tuple[str, ...], message: str
) -> None:
    done = run_neuron("generate", "--model", str(arch_models["gemma4_text"]), *args, "hello", timeout=60)
    assert done.returncode in (1, 2) and message in done.stderr, done.stderr[-2000:]


def test_gemma4s_per_layer_tables_weigh_on_the_stages_that_hold_their_columns(arch_models: dict[str, Path]) -> None:
    """The split by memory counts gemma4's per-layer input tables with the layers, each stage holding its layers'
    columns, not with rank 0's embedding and head."""
    import mlx.core as mx

    from neuron.models.folder import weight_bytes

    path = arch_models["gemma4_text"]
    weights = mx.load(str(path / "model.safetensors"))
    assert isinstance(weights, dict)
    tables = sum(
        a.nbytes for name, a in weights.items() if "per_layer_model_projection" in name or "_per_layer." in name
    )
    elsewhere = sum(a.nbytes for name, a in weights.items() if not name.startswith("model.layers."))
    per_layer, rest = weight_bytes(path, 4)
    assert tables > 0 and rest == elsewhere - tables
    assert sum(per_layer) + rest == sum(a.nbytes for a in weights.values())


def test_gemma4s_full_attention_heads_must_divide_too() -> None:
    one_global = {**config("gemma4_text", 300), "num_global_key_value_heads": 1}
    with pytest.raises(ModelError, match="1 global key/value heads, which do not divide over 2 ranks"):
        check_splittable(one_global, 2)
    with pytest.raises(ModelError, match="nor neuron"):  # its experts are not split
        check_splittable({**config("gemma4_text", 300), "enable_moe_block": True}, 2)


def test_a_sliding_window_is_read_from_layer_types_as_mlx_lm_reads_it() -> None:
    """Mistral-7B-v0.1 sets ``sliding_window`` without ``layer_types``: mlx-lm attends in full, so TP and PP alike
    serve it as plain key/value."""
    v01 = {**config("llama", 300), "model_type": "mistral", "sliding_window": 4096}
    assert architectures.supports(v01) == architectures.TABLE["mistral"]
    check_splittable(v01, 2, 2)
    windowed = config("windowed_mistral", 300)
    assert architectures.supports(windowed).caches == architectures.WINDOW  # type: ignore[union-attr]


def test_an_architecture_outside_the_table_is_served_as_mlx_lm_splits_it() -> None:
    gemma = {"model_type": "gemma", "num_hidden_layers": 4, "vocab_size": 10, "hidden_size": 8}
    assert architectures.supports(gemma) is None
    check_splittable(gemma, 1)
    with pytest.raises(ModelError, match="not split 'gemma' into pipeline stages"):
        check_splittable(gemma, 2, 2)


@pytest.mark.parametrize("arch", ["qwen3_5", "gpt_oss", "gemma4_text"])
def test_a_rank_that_cannot_follow_a_plan_runs_it_on_throwaway_caches_of_every_kind(
    arch: str, arch_models: dict[str, Path]
) -> None:
    """The desync path: a rank that does not hold what the plan names still runs every pass (so a group's
    collectives match) on fresh caches of the model's own kinds, records nothing, and says why."""
    from neuron.rank.rank import Rank, RankError
    from neuron.rpc import Decode, Prefill, StepPlan

    rank = Rank(0, 1)
    rank.load(str(arch_models[arch]), [])
    plan = StepPlan(
        prefill=[Prefill(1, 0, PROMPTS[2], True), Prefill(2, 5, PROMPTS[0], False)],
        decode=[Decode(3, 7, 0), Decode(4, 9, 0)],
    )
    with pytest.raises(RankError, match="desync: sequence 2 is fed a prompt chunk at 5"):
        rank.step(plan)
    assert not rank.held.seqs and not rank.held.batch.micro_batches
    logits = rank.step(StepPlan(prefill=[Prefill(1, 0, PROMPTS[2], True)]))  # and it serves on
    assert logits is not None and logits[1].shape[-1] == 260


@pytest.mark.parametrize("arch", ARCHS)
def test_the_prefix_caches_sizes_are_what_a_saved_prompt_holds(arch: str, arch_models: dict[str, Path]) -> None:
    """The prefix cache's budget is only as good as these figures: deepseek_v3 keeps a latent per token, not keys
    and values per head; a window holds its whole buffer from a prompt's end on; a linear-attention state has one
    size whatever the length."""
    from neuron.models.folder import cache_bytes
    from neuron.rank.rank import Rank
    from neuron.rpc import Prefill, Save, StepPlan

    rank = Rank(0, 1)
    rank.load(str(arch_models[arch]), [])
    per_token, per_entry = cache_bytes(arch_models[arch], [], 1)
    for seq, prompt in enumerate(PROMPTS[:3], start=1):  # shorter than a window, and longer
        rank.step(StepPlan(prefill=[Prefill(seq, 0, prompt, True)], save=[Save(seq, seq)]))
        held = rank.held.entries._held[seq].layers
        measured = sum(sum(a.nbytes for a in layer) if isinstance(layer, tuple) else layer.nbytes for layer in held)
        assert measured == per_token * len(prompt) + per_entry, len(prompt)


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_5"])
def test_a_snapshot_restores_only_the_whole_prompt_it_saved(arch: str, arch_models: dict[str, Path]) -> None:
    """A window's or a state's entry is the cache at its prompt's end: a plan restoring a shorter beginning is a
    desync on the rank, said as such, never a cache that holds what it should not."""
    from neuron.rank.rank import Rank, RankError
    from neuron.rpc import Prefill, Restore, Save, StepPlan

    rank = Rank(0, 1)
    rank.load(str(arch_models[arch]), [])
    prompt = PROMPTS[2]
    rank.step(StepPlan(prefill=[Prefill(1, 0, prompt, True)], save=[Save(1, 1)]))
    cut = len(prompt) - 3
    with pytest.raises(RankError, match=f"holds a snapshot of {len(prompt)} tokens, which cannot be cut back to {cut}"):
        rank.step(StepPlan(prefill=[Prefill(2, cut, prompt[cut:], True)], restore=[Restore(2, 1, cut)]))
    logits = rank.step(StepPlan(prefill=[Prefill(3, len(prompt), [5, 6], True)], restore=[Restore(3, 1, len(prompt))]))
    assert logits is not None and 3 in logits


def test_the_table_says_who_splits_each_architecture_as_mlx_lm_and_neuron_have_it() -> None:
    from mlx_lm.utils import _get_classes

    from neuron.rank.model.splits import SPLITS

    for arch, support in architectures.TABLE.items():
        has_shard = hasattr(_get_classes({"model_type": arch})[0], "shard")
        assert (support.tp == "mlx-lm") == has_shard, arch
        assert (support.tp == "neuron") == (arch in SPLITS), arch


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_embeds_as_mlx_lms_final_states_pool(arch: str, arch_models: dict[str, Path]) -> None:
    """Embedding inputs on one rank, in this process: two whole ones in one step (left-padded together where the
    caches take padding) and one fed over two steps, against mlx-lm's inner model's output pooled the same way."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    from neuron.rank.rank import Rank
    from neuron.rpc import Prefill, StepPlan

    path = str(arch_models[arch])
    rank = Rank(0, 1)
    rank.load(path, [])
    long = PROMPTS[2] * 3
    half = len(long) // 2
    rank.step(
        StepPlan(
            prefill=[
                Prefill(1, 0, PROMPTS[0], True, pool="MEAN"),
                Prefill(2, 0, PROMPTS[1], True, pool="MEAN"),
                Prefill(3, 0, long[:half], False, pool="LAST"),
            ]
        )
    )
    first = dict(rank.embedded)
    rank.step(StepPlan(prefill=[Prefill(3, half, long[half:], True, pool="LAST")]))
    got = {**first, **rank.embedded}
    assert not rank.held.seqs  # every input dropped at its last chunk
    model, _ = load(path)
    for seq, (ids, pooling) in {1: (PROMPTS[0], "MEAN"), 2: (PROMPTS[1], "MEAN"), 3: (long, "LAST")}.items():
        states = model.model(mx.array([ids]))[0].astype(mx.float32)
        pooled = states.mean(axis=0) if pooling == "MEAN" else states[-1]
        expected = np.array(pooled / mx.linalg.norm(pooled))
        assert np.abs(np.array(got[seq]) - expected).max() < 1e-4, (arch, seq)
