"""The repository's layout as its checks read it: where neuron's modules lie and the names they import by, and which
tier a test belongs to by the folder it lies in (tests/conftest.py applies that at collection; tests/unit/test_layout.py
checks both, and plants breaks to see each check fail)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from testkit.server import ROOT

PACKAGE = ROOT / "neuron"
SERVER = PACKAGE / "server"


def module_name(path: Path, root: Path = ROOT) -> str:
    """The name ``path`` (a file under ``root``) is imported by: ``neuron/server/__init__.py`` is ``neuron.server``."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The tiers (pyproject's markers). ``unit`` is the fast one and a folder of its own, tests/unit/: no model, no
# subprocess, milliseconds a test. Everything else is end to end unless it names its own slower tier; plain ``pytest``
# runs every tier.
UNIT = "unit"
TIERS = (UNIT, "e2e", "hosts", "packaging", "soak")
MODEL_FIXTURES = frozenset({"tiny_models", "tiny_alone", "smollm2", "smollm2_paris", "split_qwen3"})


def tier_problem(where: Path, tiers: Collection[str], fixtures: Collection[str]) -> str | None:
    """What is wrong with the tier of a test at ``where`` (its file's path under tests/) that is marked ``tiers`` and
    uses ``fixtures``; None where nothing is. A test under tests/unit/ is a unit test (conftest marks it so) and may
    be nothing else; a test elsewhere is not one, whatever its marks say."""
    if len(set(tiers)) > 1:
        return f"is marked {' and '.join(tiers)}: a test belongs to one tier"
    in_unit = where.parts[:1] == (UNIT,)
    if in_unit and (others := [t for t in tiers if t != UNIT]):
        return f"lies under tests/unit/ but is marked {others[0]}: a slower test lies outside the fast tier's folder"
    if not in_unit and UNIT in tiers:
        return "is marked unit but lies outside tests/unit/: the fast tier is that folder, move the test there"
    if in_unit and (models := MODEL_FIXTURES & set(fixtures)):
        return f"is a unit test (under tests/unit/) but uses {', '.join(sorted(models))}"
    return None
