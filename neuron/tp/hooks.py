"""Faults a test can inject into a rank, set through the environment; production never sets them.

``NEURON_TEST_FAIL_STEP`` makes a rank fail after given steps, with every
collective of the step done, as a bug in post-processing would.
``NEURON_TEST_DESYNC_STEP`` makes a rank silently record a wrong token for a
sequence after given steps, so that its state digest differs from its peers'.
``NEURON_TEST_DROP_ENTRY`` makes a rank lose a prefix-cache entry after
given steps, as a rank whose cache went its own way would.
All read ``RANK:STEP[,STEP...]``, several ranks joined by ``;``
(``0:50;1:20,80``). The soak and desync tests rest on them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

FAULT_ENV = "NEURON_TEST_FAIL_STEP"
DESYNC_ENV = "NEURON_TEST_DESYNC_STEP"
DROP_ENTRY_ENV = "NEURON_TEST_DROP_ENTRY"


class _Position(Protocol):
    last: int


class _Entries(Protocol):
    def drop_one(self) -> None: ...


def _steps(env: str, rank: int) -> frozenset[int]:
    steps: set[int] = set()
    for spec in filter(None, os.environ.get(env, "").split(";")):
        hook_rank, _, listed = spec.partition(":")
        if int(hook_rank) == rank:
            steps.update(int(step) for step in listed.split(","))
    return frozenset(steps)


@dataclass(frozen=True, slots=True)
class Hooks:
    rank: int
    fail_at: frozenset[int] = frozenset()
    desync_at: frozenset[int] = frozenset()
    drop_entry_at: frozenset[int] = frozenset()

    @classmethod
    def read(cls, rank: int) -> Hooks:
        return cls(rank, _steps(FAULT_ENV, rank), _steps(DESYNC_ENV, rank), _steps(DROP_ENTRY_ENV, rank))

    def after_step(self, step: int, seqs: dict[int, _Position], entries: _Entries) -> str | None:
        """Called once a step's collectives are all done: corrupt its state, or return a failure to raise."""
        if step in self.desync_at and seqs:
            seqs[min(seqs)].last += 1
        if step in self.drop_entry_at:
            entries.drop_one()
        if step in self.fail_at:
            return f"rank {self.rank}: injected failure after step {step} ({FAULT_ENV})"
        return None
