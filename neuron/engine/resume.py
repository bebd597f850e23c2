"""Requests that outlive a lost group: whom a loss is blamed on, and why a paused request gives up.

When a rank is lost (it died, hung past the step deadline, its SSH session
was cut, or its state went its own way), the engine pauses the batch rather
than failing it: each sequence goes back to the queue and, once the pool is
back with fresh workers, is fed its prompt and the tokens it already produced
as a prefill, and its stream goes on (``Scheduler.pause``). Two bounds keep a
request from waiting forever: the pool must be back within ``resume_timeout``
seconds of the loss, and a request blamed for more than ``resume_tries``
losses is given up, since it may be what kills the rank. Decisions only: no
I/O, no MLX.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from neuron.engine.sequence import Pause, Sequence
from neuron.step import Step


def blamed(step: Step | None, batch: Iterable[Sequence]) -> set[Sequence]:
    """The sequences a loss counts against: those whose tokens the failed step fed as a prompt (a prompt that
    crashes a rank crashes it as it is fed), else every sequence of the step; with no step in flight (a worker
    that died between steps), every sequence of the batch."""
    batch = list(batch)
    if step is None:
        return set(batch)
    fed = {chunk.seq for chunk in step.plan.prefill}
    stepped = fed or fed | {row.seq for row in step.plan.decode}
    return {seq for seq in batch if seq.no in stepped}


def lost(failures: dict[int, str], hosts: list[str], cause: str) -> Pause:
    """What a paused sequence remembers of the loss: the rank that failed (a worker's before rank 0's, which
    only says it stopped waiting for one), its host, and why."""
    workers = [r for r in failures if r != 0]
    rank = min(workers) if workers else min(failures, default=0)
    return Pause("lost", rank, hosts[rank] if rank < len(hosts) else "?", cause, time.perf_counter())


def timed_out(lost: Pause, timeout: float) -> str:
    return (
        f"the group was lost ({lost.cause}) and was not back within {timeout:g} s (--resume-timeout): retry the request"
    )


def too_many_losses(seq: Sequence, tries: int, cause: str) -> str:
    return (
        f"the group was lost {seq.losses} times while this request was being fed or decoded (last: {cause}); "
        f"it may be what kills a rank, so it is not resumed again (--resume-tries {tries})"
    )
