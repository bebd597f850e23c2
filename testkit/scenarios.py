"""The leader-side scenarios (testkit/leader_scenarios.py) run from a test: each in a fresh process, since MLX lets a
process host rank 0 of one group only; its result is the JSON line it prints last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from testkit.server import ROOT

# Run as a module from the repository's root, where testkit is found.
SCENARIO_COMMAND = [sys.executable, "-m", "testkit.leader_scenarios"]

TP1_TOKENS = 32  # greedy tokens in tests/e2e/parallel/conftest.py's ``tiny_tp1`` reference


def scenario_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A scenario's environment: it imports testkit from the repository's root, whatever the interpreter's path."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path} | (env or {})


def scenario(name: str, *args: Any, env: dict[str, str] | None = None, timeout: float = 300) -> Any:
    done = subprocess.run(
        [*SCENARIO_COMMAND, name, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=scenario_env(env),
    )
    assert done.returncode == 0, f"scenario {name} failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def scenarios_side_by_side(*calls: tuple[Any, ...]) -> list[Any]:
    """``scenario`` for each call (its name, then its arguments), run side by side (a run starts with one process
    importing, so their starts overlap on the cores); each one's result, in order."""
    with ThreadPoolExecutor(len(calls)) as runs:
        return list(runs.map(lambda call: scenario(*call), calls))
