"""Memory pressure, as the engine meets it: every rank's memory followed into the budget (``engine.memory``) and
shown, and what the budget does to the batch said and counted: a sequence preempted, one that cannot go on, an
allocation that failed anyway.

The decisions are the scheduler's and the budget's; this is where they meet the pool (a rank's memory read now),
the log and ``/metrics``. The engine holds one and calls it from its step loop.
"""

from __future__ import annotations

import time

import structlog

from neuron import metrics
from neuron.engine.memory import Budget
from neuron.engine.output import Output
from neuron.engine.scheduler import Scheduler
from neuron.engine.sequence import Pause, Sequence
from neuron.pool import Pool, PoolError

log = structlog.get_logger("neuron.engine")


# The images of the requests in flight (a model that takes images) may hold at most this share of rank 0's memory,
# which the budget keeps free for them (rank 0 encodes them; the engine refuses more: ``Engine.submit``).
IMAGES_SHARE = 1 / 8


class Pressure:
    def __init__(
        self,
        pool: Pool,
        budget: Budget,
        scheduler: Scheduler,
        output: Output,
        vocab_size: int,
        vision: bool = False,
    ) -> None:
        self.pool = pool
        self.budget = budget
        self.scheduler = scheduler
        self.output = output
        self.vocab_size = vocab_size
        self.vision = vision  # the model takes images: the budget keeps room for them on rank 0

    async def read(self, calibrate: bool = False) -> None:
        """Read every rank's memory now and follow it (``calibrate``: right after the calibration step, which says
        what a step takes beyond the caches), then keep MLX within each rank's budget where it enforces its limits
        (``RankBudget.mlx_limits``); raises the pool's error if a rank fails to answer."""
        readings = await self.pool.read_memory()
        if calibrate and self.vision:
            self.budget.images = int(readings[0].total * IMAGES_SHARE)
        (self.budget.calibrate if calibrate else self.budget.read)(readings)
        readings = await self.pool.read_memory({budget.rank: budget.mlx_limits for budget in self.budget.ranks})
        self.budget.read(readings)
        self.scheduler.size_prefix_cache()
        self._publish()
        self.scheduler.scored_chunk = self.budget.scored_chunk(self.vocab_size)
        rank, host = self.budget.where()
        log.info(
            "memory budget",
            budget_bytes=self.budget.bytes,
            rank=rank,
            host=host,
            longest_tokens=self.budget.longest(),
            prefix_cache_bytes=self.scheduler.limits.prefix_cache_bytes,
            ranks=[budget.describe() for budget in self.budget.ranks],
        )

    def follow(self) -> None:
        """The budget follows each rank's memory, as a step has just read it again (every few seconds: ``Loop``)."""
        self.budget.read(self.pool.memory)
        self._publish()

    def usage(self) -> float:
        """The share of the budget the batch's caches and the prefix cache hold (vLLM's KV cache usage)."""
        prefix = self.scheduler.prefix
        held = self.scheduler.usage() + (prefix.bytes if prefix else 0)
        return held / self.budget.bytes if self.budget.bytes else 0.0

    def said(self, preempted: list[Sequence], unfit: list[Sequence]) -> None:
        """Say what the budget (or a request of higher priority) did to the batch this turn: who was preempted,
        who cannot go on at all."""
        rank, host = self.budget.where()
        for seq in preempted:
            reason = seq.paused.reason if seq.paused is not None else "memory"
            metrics.PREEMPTIONS.labels(reason).inc()
            where = {"budget_bytes": self.budget.bytes, "rank": rank, "host": host} if reason == "memory" else {}
            cause = {"cause": seq.paused.cause} if seq.paused is not None and reason != "memory" else {}
            log.warning("preempted", **seq.ids, reason=reason, tokens=len(seq.tokens), **where, **cause)
        for seq in unfit:
            self.output.failed(
                seq,
                "unavailable",
                f"this request's caches ({len(seq.prompt) + seq.completion_tokens} tokens) no longer fit in the "
                f"memory budget, which shrank to {self.budget.bytes} bytes on rank {rank} on {host} (another "
                "process took memory there); retry it, or give that host more memory",
            )

    def failed(self, error: PoolError) -> list[tuple[Sequence, int]]:
        """A rank failed to allocate anyway (MLX out of memory on its device): from now on the budget is at most
        ``AFTER_FAILURE`` of what the caches held, so that the batch resumes with fewer rows; every sequence of the
        batch is paused, its stream open, blamed for nothing. Returns those whose callers had gone (they leave)."""
        prefix = self.scheduler.prefix
        held = self.scheduler.usage() + (prefix.bytes if prefix else 0)
        cap = self.budget.lower_after_failure(held)
        rank = min(error.failures, default=0)
        host = self.pool.hosts[rank] if rank < len(self.pool.hosts) else "?"
        pause = Pause("allocation_failed", rank, host, str(error), time.perf_counter())
        paused = self.scheduler.queues.pause(pause, (), self.scheduler.limits.resume_tries)
        metrics.PREEMPTIONS.labels("allocation_failed").inc(len(paused.paused))
        log.error(
            "out of memory",
            error=str(error),
            paused=len(paused.paused),
            held_bytes=held,
            cap_bytes=cap,
            rank=rank,
            host=host,
        )
        return paused.cancelled

    def _publish(self) -> None:
        for budget in self.budget.ranks:
            for part, value in budget.describe().items():
                if part.endswith("_bytes"):
                    metrics.MEMORY_BYTES.labels(str(budget.rank), part.removesuffix("_bytes")).set(float(value))
