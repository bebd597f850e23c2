"""The pool: rank 0 on a thread here, one worker process per other rank, and every operation as a fan-out.

Every operation sends the request to every worker without waiting, does rank
0's share here, then drains exactly one reply from every worker that was sent
one (``fanout.py`` says why).

Why rank 0 lives in the leader: it samples. The logits never leave the process
that computed them, and the next token reaches the workers inside the next
step's request, so nothing but small JSON crosses a pipe.

The pool holds four parts, each given what it shares with the others when it
is made: the ranks (``ranks.py``: the workers spawned, the group formed, the
fan-out, rank 0's thread, shutdown), the model loaded onto them
(``loading.py``), the replacement of a lost group (``replacement.py``) and the
watch on the workers (``watch.py``). This module runs the steps on the ranks
and is the face the engine sees.

A pool is *broken* when its group can no longer be trusted: a worker died, went
silent past a deadline, broke the protocol, or a collective failed. Every later
call then fails at once, naming the cause, until ``recover`` replaces every
worker and rank 0's group in this process (where MLX can forget a group:
``rank.dist.backends``); where it cannot, recovery is a fresh process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import structlog

from neuron import metrics, rpc
from neuron.launch.checks import Crowded
from neuron.launch.hosts import Host
from neuron.models import hub
from neuron.pool.fanout import Deadlines, PoolError, Timing
from neuron.pool.link import Link
from neuron.pool.loading import Loader
from neuron.pool.probe import probe_spare
from neuron.pool.ranks import Layout, Ranks, check_backend
from neuron.pool.replacement import Replacement
from neuron.pool.roster import Roster
from neuron.pool.spares import Spares
from neuron.pool.watch import Watch
from neuron.rank.rank import Loaded, Rank, Stepped, run
from neuron.step import DraftRow, Sampled, Step

log = structlog.get_logger("neuron.pool")


class Pool:
    """``model_path`` over the ranks of ``layout``: rank 0 on a thread here, ranks 1.. as worker processes.

    Use it as an async context manager: entering checks the model can be split
    (before any worker exists), spawns, pings and joins the group; leaving
    shuts every worker down, whatever happened in between.
    """

    def __init__(
        self,
        model_path: str | Path,
        layout: Layout | None = None,
        deadlines: Deadlines | None = None,
        model: str | None = None,
    ) -> None:
        self.layout = layout or Layout.local(1)
        check_backend(self.layout.backend)
        self.model_path = str(Path(model_path).resolve())
        model = hub.pinned(model, self.model_path)  # what --model said: a host of its own resolves it there
        self.deadlines = deadlines or Deadlines()
        self._ranks = ranks = Ranks(self.layout, self.deadlines, model)
        self._fan_out = ranks.fan_out  # the same for the pool's life: a step reaches it without a hop through ranks
        self.launcher = ranks.launcher
        self.backend = ranks.backend
        self.hosts = ranks.hosts
        self._loader = Loader(ranks, self.model_path, model)
        self._replacement = Replacement(ranks, self._loader)
        self._watch = Watch(ranks)
        self.spares = Spares(self.launcher.hosts, self.layout.spares, self.layout.spare_timeout)
        # The hosts as they change while serving: moves to spares, and what the operator adds, drains or removes.
        self.roster = Roster(ranks, self.spares, self.layout.hostfile, self._probe_spare, self._loader.shrunk)

    async def __aenter__(self) -> Pool:
        self._loader.check_split()
        await self._ranks.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.shutdown()

    def place_rank0(self, short: bool | None) -> None:
        """Place rank 0's threads, and the event loop's, for steps as long as timed (``Rank0Thread.place``)."""
        self._fan_out.rank0.place(short)

    @property
    def timing(self) -> Timing:
        """Where the latest operation's seconds went, each rank's among them (a step's, after ``step``)."""
        return self._fan_out.timing

    async def step(self, step: Step, read_memory: bool = False) -> dict[int, Sampled]:
        """One batched step on every rank; returns what rank 0 sampled for each sequence that has logits.

        Every rank runs ``step.plan``; rank 0's sampler also reads ``step.starts``. With ``read_memory``, every
        rank then reads its memory, and the pool keeps the readings (``memory``).
        Every worker's fingerprint of its state must equal rank 0's, or the step
        fails as a desync naming the rank (the group stays usable once cleared).
        """
        if not self.loaded:
            # Refused here, not by the ranks: after a load that failed on some ranks
            # only, the ranks that have a model would wait in a collective for those
            # that refuse.
            raise PoolError(
                "generate_step", {0: "no model is loaded on every rank; load one first"}, broken=False, hosts=self.hosts
            )
        head = self._fan_out.rank0.head
        plan = step.plan
        gauge = self._ranks.gauge
        read: list[rpc.Memory | None] = [None]

        def on_rank(rank: Rank) -> Stepped:
            stepped = run(rank, step, head)
            if read_memory:  # on rank 0's thread, as a worker reads its own
                read[0] = gauge.read(lambda: (rank.held.nbytes(), rank.peak))
            return stepped

        replies = await self._fan_out(
            "generate_step",
            lambda _, id: rpc.GenerateStep(id=id, plan=plan, read_memory=read_memory),
            on_rank,
            self.deadlines.step,
        )
        timing = self._fan_out.timing
        metrics.STEP_SECONDS.labels("total").observe(timing.total)
        metrics.STEP_SECONDS.labels("rank0").observe(timing.rank0)
        if self.workers:
            metrics.STEP_SECONDS.labels("fanout").observe(timing.fan_out)
            metrics.STEP_SECONDS.labels("drain").observe(timing.drain)
        mine = replies[0]
        expected = mine.fingerprint
        if mine.queued:
            metrics.STEPS_AHEAD.inc()
        desynced = {
            r: f"desync: its state digest {reply.fingerprint} differs from rank 0's {expected}"
            for r, reply in replies.items()
            if r != 0 and reply.fingerprint != expected
        }
        if desynced:
            metrics.DESYNCS.inc()
            log.error("desync", op="generate_step", failures=desynced)
            raise PoolError("generate_step", desynced, broken=False, hosts=self.hosts)
        # Each rank's latest memory reading: the workers' ride on their replies, rank 0 read its own the same way.
        memory = self._ranks.memory
        if read[0] is not None:
            memory[0] = read[0]
        for rank, reply in replies.items():
            if rank != 0 and reply.memory is not None:
                memory[rank] = reply.memory
        return mine.sampled

    async def draft(self, rows: list[DraftRow]) -> dict[int, list[int]]:
        """The draft model's tokens for ``rows``, proposed on rank 0's thread (``rank.head.drafter``), which keeps their
        distributions for the step that verifies them: call it right before that step."""
        head = self._fan_out.rank0.head
        try:
            return await self._fan_out.rank0.call(lambda _: head.propose(rows), self.deadlines.step)
        except Exception as e:  # any reason is the operator's to read, as a failed step's
            raise PoolError("draft", {0: f"{type(e).__name__}: {e}"}, broken=False, hosts=self.hosts) from e

    async def clear_kv_cache(self, prefixes: bool = True) -> None:
        """Drop every sequence on every rank; with ``prefixes``, every prefix-cache entry too."""
        head = self._fan_out.rank0.head

        def clear(rank: Rank) -> None:
            rank.clear_kv_cache(prefixes)
            head.clear()

        await self._fan_out(
            "clear_kv_cache", lambda _, id: rpc.ClearKvCache(id=id, prefixes=prefixes), clear, self.deadlines.control
        )
        log.debug("kv cache cleared", ranks=self.world_size, prefixes=prefixes)

    async def open_prefix_disk(self, folder: str, budget: int, stamp: str) -> dict[int, dict[str, int]]:
        """Have every rank spill prefix-cache entries to ``folder`` (``rpc.OpenPrefixDisk``); returns, per rank,
        the files there it may load: key -> tokens."""
        opened = await self._fan_out(
            "open_prefix_disk",
            lambda _, id: rpc.OpenPrefixDisk(id=id, folder=folder, budget=budget, stamp=stamp),
            lambda rank: rpc.PrefixDiskOpened(id=0, saved=rank.open_disk(folder, budget, stamp)),
            self.deadlines.load,
        )
        return {rank: reply.saved for rank, reply in opened.items()}

    async def load_prefixes(self, entries: dict[str, int], drop: list[int] | None = None) -> set[str]:
        """Every rank drops the entries ``drop`` names where it holds them, then loads the files ``entries`` names
        (key -> entry id); returns the keys some rank could not load."""
        dropped = drop or []
        loaded = await self._fan_out(
            "load_prefixes",
            lambda _, id: rpc.LoadPrefixes(id=id, entries=entries, drop=dropped),
            lambda rank: rpc.PrefixesLoaded(id=0, failed=rank.held.entries.load(entries, dropped)),
            self.deadlines.load,
        )
        return {key for reply in loaded.values() for key in reply.failed}

    async def flush_prefix_disk(self) -> bool:
        """Wait for every rank's spilled entries to be written; True if all were in time."""
        flushed = await self._fan_out(
            "flush_prefix_disk",
            lambda _, id: rpc.FlushPrefixDisk(id=id),
            lambda rank: rpc.PrefixDiskFlushed(id=0, written=rank.flush_disk(rpc.FLUSH_S)),
            self.deadlines.control,
        )
        return all(reply.written for reply in flushed.values())

    async def watch(self, on_lost: Callable[[PoolError], None]) -> None:
        """Wait on every worker process, and on every SSH tunnel connection of ``--data-plane ssh``; the moment
        one exits unasked, break the pool and call ``on_lost``. Runs until cancelled, following the workers and
        tunnels each ``recover`` starts (``watch.py``)."""
        await self._watch.run(on_lost)

    async def recover(self) -> None:
        """Replace a lost group in this process (``Replacement.recover``: ``Unrecoverable`` where it cannot), then
        have the watch follow the fresh workers."""
        await self._replacement.recover()
        self._watch.follow()
        metrics.WORKER_RESTARTS.inc()

    async def _probe_spare(self, spare: Host) -> rpc.HostInfo:
        """A new spare asked who it is, with room needed for the largest rank's share of the weights."""
        return await probe_spare(self._ranks, spare, max(self._loader.weights, default=0), self._loader.model_path)

    async def shutdown(self) -> None:
        """Ask every worker to leave, reap it, and kill any that has not exited by the deadline."""
        await self._ranks.shutdown()

    # What the parts know, read here as the rest of neuron reads the pool.

    @property
    def world_size(self) -> int:
        """The group's size, which shrinks where hosts stay out of reach with no spare left (``Roster.shrink_due``)."""
        return self._ranks.world_size

    @property
    def workers(self) -> tuple[Link, ...]:
        return tuple(self._fan_out.workers)

    @property
    def broken(self) -> PoolError | None:
        return self._fan_out.broken

    @property
    def said(self) -> tuple[rpc.HostInfo, ...]:
        return self._ranks.said

    @property
    def crowded(self) -> list[Crowded]:
        return self._ranks.crowded

    @property
    def memory(self) -> dict[int, rpc.Memory]:
        return self._ranks.memory

    async def read_memory(self, limits: dict[int, tuple[int, int]] | None = None) -> dict[int, rpc.Memory]:
        return await self._ranks.read_memory(limits)

    async def ping(self) -> dict[int, rpc.Pong]:
        return await self._ranks.ping()

    async def load(self) -> dict[int, Loaded]:
        return await self._loader.load()

    async def load_adapter(self, number: int, name: str, path: str) -> list[int]:
        return await self._loader.load_adapter(number, name, path)

    async def unload_adapter(self, number: int) -> None:
        await self._loader.unload_adapter(number)

    @property
    def loaded(self) -> bool:
        return self._loader.loaded

    @property
    def layers(self) -> list[tuple[int, int]]:
        return self._loader.layers

    @property
    def weights(self) -> list[int]:
        return self._loader.weights

    @property
    def adapters(self) -> dict[int, tuple[str, str]]:
        return self._loader.adapters

    @property
    def cache_shares(self) -> list[tuple[int, int]]:
        return self._loader.cache_shares

    @property
    def cache_bytes(self) -> tuple[int, int]:
        return self._loader.cache_bytes

    @property
    def draft_path(self) -> Path | None:
        return self._loader.draft_path

    @draft_path.setter
    def draft_path(self, path: Path | None) -> None:
        self._loader.draft_path = path

    @property
    def mtp(self) -> bool:
        return self._loader.mtp

    @mtp.setter
    def mtp(self, mtp: bool) -> None:
        self._loader.mtp = mtp

    @property
    def kv_bits(self) -> int | None:
        return self._loader.kv_bits

    @kv_bits.setter
    def kv_bits(self, bits: int | None) -> None:
        self._loader.kv_bits = bits

    @property
    def unrecoverable(self) -> str | None:
        return self._replacement.unrecoverable
