"""The walk of one decode step in docs/architecture.md is the step's own: the modules a steady step enters on the
leader are the ones the walk names, each in its place, and a worker's are among them (``testkit.stepwalk``)."""

from __future__ import annotations

import re
from pathlib import Path

from testkit import ROOT
from testkit.stepwalk import LEADER, WORKER, steady_step

ARCHITECTURE = ROOT / "docs" / "architecture.md"
# Entered only by the step that reads every rank's memory, every few seconds (the walk's stop 13 says so): the traced
# step may be that one on a slow machine.
WHEN_MEMORY_IS_READ = {"neuron.launch.hosts", "neuron.engine.pressure"}


def walked(text: str) -> list[str]:
    """The modules the walk's stops name in their titles (``1. **`engine/loop.py`: the loop.**``), in order."""
    titles = re.findall(r"^\d+\. \*\*(.+?)\*\*", text, flags=re.M | re.S)
    paths = [path for title in titles for path in re.findall(r"`([\w/]+)\.py`", title)]
    return [
        path.replace("/", ".") if path.startswith("neuron/") else f"neuron.{path.replace('/', '.')}" for path in paths
    ]


def test_the_walk_reads_the_modules_in_its_stops_titles() -> None:
    text = (
        "1. **`engine/loop.py`: the loop.** `pool/other.py` is not one.\n"
        "2. **`rpc/plan.py`, `neuron/step.py`:\nthe\ncontract.**"
    )
    assert walked(text) == ["neuron.engine.loop", "neuron.rpc.plan", "neuron.step"]


def test_a_steady_step_enters_the_modules_the_walk_names_and_no_other(tmp_path: Path) -> None:
    walks = steady_step(tmp_path, tp=2)
    documented = walked(ARCHITECTURE.read_text())
    leader = [module for module, _ in walks[LEADER] if module not in WHEN_MEMORY_IS_READ]
    assert set(leader) == set(documented), (
        f"entered, not in the walk: {sorted(set(leader) - set(documented))}; "
        f"in the walk, not entered: {sorted(set(documented) - set(leader))}"
    )
    worker = {module for module, _ in walks[WORKER]} - WHEN_MEMORY_IS_READ
    assert worker - {"neuron.cli.worker"} <= set(documented), sorted(worker - set(documented))
    stop_13 = ARCHITECTURE.read_text().split("\n13. ")[1].split("\n14. ")[0]
    assert all(f"`{m.removeprefix('neuron.').replace('.', '/')}.py`" in stop_13 for m in WHEN_MEMORY_IS_READ)
