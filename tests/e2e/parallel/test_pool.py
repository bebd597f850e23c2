"""The leader's pool with real worker processes and a real ring group on loopback.

Each multi-rank scenario runs in a fresh leader process (testkit/leader_scenarios.py):
MLX lets a process host rank 0 of one group only.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from neuron.pool import Layout, Pool
from testkit import ROOT, alive, make_tiny_model, wait_until
from testkit.faults import FAIL_ENV
from testkit.scenarios import SCENARIO_COMMAND, TP1_TOKENS, scenario, scenario_env, scenarios_side_by_side


@pytest.fixture(scope="module")
def clean_tokens(tiny_tp1: dict[str, dict]) -> dict[str, list[int]]:
    """Greedy tokens of each tiny model at TP=1: the reference every multi-rank run must reproduce."""
    return {arch: alone["tokens"] for arch, alone in tiny_tp1.items()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_spawn_ping_group_and_shutdown(tiny_models: dict[str, Path], smollm2: Path, world_size: int) -> None:
    model = tiny_models["llama"] if world_size == 2 else smollm2  # SmolLM2's 9 and 3 heads split over 3 ranks
    result = scenario("spawn", str(model), world_size)
    assert len(result["pids"]) == world_size - 1
    assert not any(alive(pid) for pid in result["pids"])
    # A step before the model is loaded on every rank is refused by the leader, not sent to the ranks.
    assert result["step_error"].startswith("broken=False") and "load one first" in result["step_error"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_greedy_equals_tp1(tiny_models: dict[str, Path], tiny_tp1: dict[str, dict], arch: str) -> None:
    result = scenario("generate", str(tiny_models[arch]), 2, TP1_TOKENS)
    alone = tiny_tp1[arch]
    assert result["tokens"] == alone["tokens"]
    assert result["after_reload"] == alone["tokens"]  # loaded again over the first
    assert len(set(alone["tokens"])) > 8  # a degenerate model would make the comparison meaningless
    assert result["parameters"][0] == result["parameters"][1] < alone["parameters"][0]  # each rank holds its slices
    # Steps read no memory unless asked (the engine's loop asks every few seconds); a step that asks has every rank
    # read its own, after the step, holding the sequence's caches.
    assert result["read_unasked"] == []
    assert sorted(result["read"]) == ["0", "1"], result["read"]
    assert all(m["used"] > 0 and m["free"] > 0 and m["caches"] > 0 for m in result["read"].values()), result["read"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_vocabulary_projection_split_over_the_ranks_gives_tp1s_tokens(tmp_path: Path, arch: str) -> None:
    # 40001 x 256 is past SPLIT_HEAD_MIN_PARAMS, and odd: rank 1's rows are padded. Untied (llama) and tied (qwen3).
    model = str(make_tiny_model(tmp_path / arch, arch, vocab=40001))
    alone, split = (r["tokens"] for r in scenarios_side_by_side(("generate", model, 1, 24), ("generate", model, 2, 24)))
    assert max(alone) > 258 and len(set(alone)) > 8  # tokens from beyond the tokenizer's ids: the whole head counts
    assert split == alone


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_injected_step_failure_leaves_the_pipes_in_step(
    tiny_models: dict[str, Path], clean_tokens: dict[str, list[int]], failing_rank: int
) -> None:
    result = scenario("fail_then_recover", str(tiny_models["llama"]), 32, env={FAIL_ENV: f"{failing_rank}:4"})
    failure = result["failure"]
    assert failure, "the injected fault did not surface"
    assert list(failure["failures"]) == [str(failing_rank)]
    assert f"rank {failing_rank}" in failure["message"] and not failure["broken"]
    # Had the leader skipped draining the failed step's replies, clear_kv_cache would have read a stale one.
    assert result["after"] == clean_tokens["llama"]


@pytest.fixture(scope="module")
def desyncs(tiny_models: dict[str, Path]) -> dict[str, Any]:
    """Both plans a rank cannot follow, run one after the other in one leader (its start is most of each run)."""
    return scenario("desyncs", str(tiny_models["llama"]), 32, timeout=120)


def test_a_plan_no_rank_can_follow_fails_on_every_rank_without_a_hang(
    desyncs: dict[str, Any], clean_tokens: dict[str, list[int]]
) -> None:
    result = desyncs["impossible"]
    failure = result["failure"]
    assert sorted(failure["failures"]) == ["0", "1"] and not failure["broken"]
    assert all("desync" in m and "sequence 42" in m for m in failure["failures"].values())
    assert result["after"] == clean_tokens["llama"]


def test_a_rank_that_alone_disagrees_still_matches_its_peers_collectives(
    desyncs: dict[str, Any], clean_tokens: dict[str, list[int]]
) -> None:
    result = desyncs["disagrees"]
    failure = result["failure"]
    assert list(failure["failures"]) == ["0"] and not failure["broken"], failure
    assert "desync" in failure["failures"]["0"] and "sequence 1" in failure["failures"]["0"]
    assert result["seconds"] < 10  # no wait on the 30 s step deadline
    assert result["after"] == clean_tokens["llama"]


def test_worker_killed_mid_step_fails_within_5s_naming_it(tiny_models: dict[str, Path]) -> None:
    result = scenario("kill_mid_step", str(tiny_models["llama"]))
    assert not result["ended_before_kill"], "the step ended before the worker could be killed mid-step"
    assert result["broken"] is True
    assert result["seconds_to_error"] < 5.0
    assert "SIGKILL" in result["failures"]["1"]
    assert result["refused_after"]  # a broken pool refuses at once instead of hanging


def test_unsplittable_model_is_refused_before_any_rank_is_spawned(tiny_models: dict[str, Path]) -> None:
    result = scenario("unsplittable", str(tiny_models["qwen3"]), 3)
    assert "4 attention heads" in result["error"] and "one of [1, 2]" in result["error"]
    assert result["spawned"] == 0 and result["seconds"] < 1


def test_no_worker_outlives_a_sigkilled_leader(smollm2: Path) -> None:
    args = json.dumps([str(smollm2), 3])
    leader = subprocess.Popen(
        [*SCENARIO_COMMAND, "hold", args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=scenario_env(),
    )
    try:
        assert leader.stdout is not None
        pids = json.loads(leader.stdout.readline())["pids"]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        leader.kill()
        leader.wait()
        wait_until(lambda: not any(alive(p) for p in pids), 10, "workers to exit after their leader died")
    finally:
        leader.kill()
        leader.wait()


@pytest.mark.anyio
async def test_a_process_hosts_one_group_only(tiny_models: dict[str, Path]) -> None:
    from neuron.rank.dist import group

    group._in_group, was = True, group._in_group
    try:
        with pytest.raises(RuntimeError, match="fresh process"):
            async with Pool(tiny_models["llama"], Layout.local(2)):
                pass
    finally:
        group._in_group = was
