"""The hosts' shared reference: what each tiny model says on one rank, which every split over hosts must say too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from testkit import run_neuron


@pytest.fixture(scope="session")
def tiny_alone(tiny_models: dict[str, Path]) -> Callable[[str], str]:
    """What ``neuron generate --max-tokens 24 hello`` prints on one rank, by tiny model: each run once for the
    session (the multi-host and push tests hold their splits to it)."""
    texts: dict[str, str] = {}

    def text(arch: str) -> str:
        if arch not in texts:
            done = run_neuron("generate", "--model", str(tiny_models[arch]), "--max-tokens", "24", "hello")
            assert done.returncode == 0, done.stderr[-3000:]
            texts[arch] = done.stdout
        return texts[arch]

    return text
