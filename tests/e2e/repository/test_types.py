"""The type checker over neuron/, as configured in pyproject.toml: mypy, in a process of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testkit import ROOT


def test_neuron_type_checks() -> None:
    pytest.importorskip("mypy", reason="mypy comes with the test extra: pip install -e '.[test]'")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", sys.executable],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-2000:]
