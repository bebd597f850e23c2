"""The declared models' servers and which of them are resident: at most ``models_max`` at once, each unloaded once
idle for its ``keep_alive``, the least recently used making room when another is asked for. One load or unload
decision at a time (``_lock``): two models loading together could outgrow the memory one of them was sized for.

A request holds its model through ``using``: counted as waiting while the model loads, then in flight while it is
forwarded. A model with either is never chosen to unload, and one being unloaded takes no new request (it waits
for the model to load again).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import structlog

from neuron.router.child import Child, LoadFailed, gib
from neuron.router.residency import Resident, expired, make_room, unload_to_fit

log = structlog.get_logger("neuron.router")


class Crowded(RuntimeError):
    """Too many requests already wait for this model to load."""


class CannotFit(RuntimeError):
    """The model does not fit this host's memory, even with every idle model unloaded; the message says how much
    it needs and which models hold the rest."""


class Holding:
    """A hold being taken in the background: ``done`` once it is held or refused (``error``). ``release`` is
    safe at any time, and once: a hold that completes after it is released at once."""

    def __init__(self, fleet: Fleet, child: Child) -> None:
        self.fleet, self.child = fleet, child
        self.done = anyio.Event()
        self.error: LoadFailed | Crowded | CannotFit | None = None
        self._held = self._released = False

    async def run(self) -> None:
        try:
            await self.fleet.hold(self.child)
            self._held = True
        except (LoadFailed, Crowded, CannotFit) as e:
            self.error = e
        finally:
            self.done.set()
            if self._released:
                self.release()

    def release(self) -> None:
        self._released = True
        if self._held:
            self._held = False
            self.fleet.release(self.child)


class Fleet:
    def __init__(
        self, children: list[Child], models_max: int | None, max_waiting: int, free: Callable[[], int]
    ) -> None:
        self.free = free  # bytes this host's memory has free now (``launch.hosts.free_memory``)
        self.children = {child.model.name: child for child in children}
        self.adapters = {adapter: child for child in children for adapter in child.model.adapters()}
        self.models_max = models_max
        self.max_waiting = max_waiting  # per model, while it loads
        self.swaps = 0  # models unloaded to make room for another
        self._lock = anyio.Lock()
        self._changed = anyio.Event()  # set when a request ends: a model may have become idle
        self._tg: anyio.abc.TaskGroup | None = None
        self.stopped = anyio.Event()

    def find(self, name: str) -> Child | None:
        """The server for ``name``: a model's, or the base model's of one of its adapters."""
        return self.children.get(name) or self.adapters.get(name)

    def names(self) -> list[str]:
        return [*self.children, *self.adapters]

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        """Preload what asks for it, then unload what stays idle past its ``keep_alive``, until cancelled."""
        self._tg = tg
        for child in self.children.values():
            if child.model.preload:
                tg.start_soon(self._preload, child)
        while True:
            await anyio.sleep(1.0)  # keep_alive is seconds or more: a second's lateness is within it
            async with self._lock:
                for name in expired(self._resident(), time.monotonic()):
                    await self._unload(self.children[name], f"idle for its keep_alive ({self._idle(name)})")

    async def _preload(self, child: Child) -> None:
        try:
            await self.ensure(child)
        except (LoadFailed, CannotFit) as e:
            log.error("model not preloaded", model=child.model.name, error=str(e))  # a request tries again

    async def hold(self, child: Child) -> None:
        """``child`` loaded and held for one request, never unloaded until ``release``: ``Crowded`` when too
        many wait for it already, ``LoadFailed`` when the load it waited for failed."""
        if child.state != "loaded" and child.waiting >= self.max_waiting:
            raise Crowded(f"{child.waiting} requests already wait for {child.model.name} to load")
        child.waiting += 1
        child.last_used = time.monotonic()
        try:
            await self.ensure(child)
        finally:
            child.waiting -= 1
        child.in_flight += 1

    def release(self, child: Child) -> None:
        child.in_flight -= 1
        child.last_used = time.monotonic()
        self._changed.set()  # every waiter wakes and looks again; later ones wait for the next change
        self._changed = anyio.Event()

    @asynccontextmanager
    async def using(self, child: Child) -> AsyncIterator[None]:
        await self.hold(child)
        try:
            yield
        finally:
            self.release(child)

    def hold_soon(self, child: Child) -> Holding:
        """``hold`` in a task of the fleet's own, for a stream that says something while it waits: the stream's
        generator may be closed from anywhere, and must not own a task group."""
        holding = Holding(self, child)
        assert self._tg is not None
        self._tg.start_soon(holding.run)
        return holding

    async def ensure(self, child: Child) -> None:
        """Load ``child`` unless it is loaded, making room first; ``LoadFailed`` when the load that this caller
        waited for failed (a later request tries again)."""
        attempt = child.attempts
        while child.state != "loaded":
            async with self._lock:
                if child.state == "loaded":
                    return
                if child.state == "failed" and child.attempts != attempt:
                    raise LoadFailed(child.why)
                victims = make_room(self._resident(), child.model.name, self.models_max)
                if victims is not None:
                    victims += self._to_fit(child, victims)
                    for name in victims:
                        self.swaps += 1
                        await self._unload(self.children[name], f"least recently used: room for {child.model.name}")
                    assert self._tg is not None
                    child.attempts += 1
                    await child.start(self._tg)
                    return
                changed = self._changed
            await changed.wait()  # every resident model is busy: one must become idle first

    async def load(self, name: str) -> Child:
        child = self.children[name]
        await self.ensure(child)
        return child

    async def unload(self, name: str, why: str) -> None:
        """Unload ``name`` once its requests in flight have ended (those waiting for it load it again after)."""
        async with self._lock:
            await self._unload(self.children[name], why)

    async def stop(self) -> None:
        """Every server stopped, each draining its own requests (the router is stopping)."""
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for child in self.children.values():
                    if child.process is not None:
                        tg.start_soon(child.stop, "the server stopped")
        self.stopped.set()

    async def kill(self) -> None:
        """Every server killed now (a second signal)."""
        for child in self.children.values():
            if child.process is not None and child.process.returncode is None:
                child.process.kill()

    async def _unload(self, child: Child, why: str) -> None:
        if child.state not in ("loaded", "loading", "failed") or child.process is None:
            return
        child.state = "unloading"
        while child.in_flight:
            await self._changed.wait()
        await child.stop(why)

    def _resident(self) -> list[Resident]:
        return [
            Resident(c.model.name, c.waiting + c.in_flight, c.last_used, c.keep_alive, c.held())
            for c in self.children.values()
            if c.state in ("loaded", "loading")
        ]

    def _to_fit(self, child: Child, victims: list[str]) -> list[str]:
        """The idle models to unload beyond ``victims`` so that ``child`` fits this host's memory; ``CannotFit``
        when it cannot."""
        if (need := child.need()) is None:
            return []
        resident = [r for r in self._resident() if r.name != child.model.name]
        free = self.free() + sum(r.held for r in resident if r.name in victims)
        more = unload_to_fit([r for r in resident if r.name not in victims], need, free)
        if more is not None:
            return more
        holders = [f"{r.name} holds {gib(r.held)}{' (in use)' if r.busy else ''}" for r in resident]
        raise CannotFit(
            f"{child.model.name} needs about {gib(need)} here (its weights and its server), and this host has "
            f"{gib(free)} free{'; ' + ', '.join(holders) if holders else ''}: unload one (/models/unload), wait "
            "for the busy ones, or serve it on more hosts (a [[models]] table's hosts)"
        )

    def _idle(self, name: str) -> str:
        return f"{self.children[name].keep_alive:g} s"
