"""Replace this process with a fresh ``neuron`` of the same arguments: the one way a process starts over.

Two things need it. The Linux CPU fast path: a BLAS library can only be
preloaded before a process starts, so the leader re-executes itself once with
it. And recovery: MLX allows one distributed group per process, so a leader
whose group was lost re-executes itself (same pid, which systemd keeps
watching) with fresh workers. No MLX here: it must run before MLX loads.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

# The module that starts neuron: run to re-execute this process and to start a worker. A test's entry point that
# wraps neuron (testkit.faults, which injects faults into ranks) names itself here, so its processes stay its own.
MODULE = "neuron"


def command() -> list[str]:
    """How this interpreter starts neuron: ``python -m neuron``."""
    return [sys.executable, "-m", MODULE]


def reexec(env: dict[str, str]) -> NoReturn:
    """Exec ``python -m neuron`` with this process's arguments and ``env``; descriptors marked inheritable stay."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [*command(), *sys.argv[1:]], env)
