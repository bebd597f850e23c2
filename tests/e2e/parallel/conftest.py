"""The pool's and the pipeline's shared reference: each tiny model's greedy tokens on one rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.scenarios import TP1_TOKENS, scenarios_side_by_side


@pytest.fixture(scope="session")
def tiny_tp1(tiny_models: dict[str, Path]) -> dict[str, dict]:
    """Each tiny model on one rank in a fresh leader (testkit/leader_scenarios.py's ``generate``): its greedy tokens
    and its parameter count, the reference the pool and pipeline tests hold their splits to; run once for the
    session."""
    runs = scenarios_side_by_side(*(("generate", str(path), 1, TP1_TOKENS) for path in tiny_models.values()))
    return dict(zip(tiny_models, runs, strict=True))
