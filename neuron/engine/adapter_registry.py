"""The LoRA adapters the engine serves, by name: each loaded on every rank (``Pool.load_adapter``) under a number the
plans carry, never reused, so that no prefix-cache entry of an adapter gone is ever taken for another's."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import anyio
import structlog

from neuron.engine.refusals import RequestError, Unavailable
from neuron.engine.sequence import Sequence
from neuron.models.adapters import AdapterError, find
from neuron.pool import Pool, PoolError

log = structlog.get_logger("neuron.engine")


class Adapters:
    def __init__(self, pool: Pool, requests: Callable[[], Iterable[Sequence]]) -> None:
        self.pool = pool
        self.requests = requests  # those queued or running: an adapter one of them uses is not unloaded
        self.numbers: dict[str, int] = {}  # name -> number, in the order they were loaded
        self._loading: set[str] = set()  # names being loaded now: a second load of one waits for none
        self._next = 1  # 0 is the base model

    @property
    def names(self) -> list[str]:
        return list(self.numbers)

    def number(self, model: str | None) -> int:
        """The number of the adapter a request names; 0 for none (the base model)."""
        if model is None:
            return 0
        if model not in self.numbers:
            raise RequestError(f"no adapter `{model}` is loaded; GET /v1/models lists them", "model", "model_not_found")
        return self.numbers[model]

    async def load(self, name: str, where: str) -> None:
        """Serve the LoRA adapter at ``where`` (a folder or a Hub name) as model ``name``, loaded on every rank;
        ``AdapterError`` saying why not (a missing file, another base model's shapes), with nothing changed."""
        if name in self.numbers or name in self._loading:
            raise AdapterError(f"adapter {name!r} is loaded already; unload it first, or give another name")
        number, self._next = self._next, self._next + 1
        self._loading.add(name)
        try:
            spec = await anyio.to_thread.run_sync(find, name, where)
            await self.pool.load_adapter(number, name, str(spec.path))
        except PoolError as e:
            if e.broken:
                raise Unavailable(f"not ready: {e}") from e
            # Every rank says the same of a bad adapter: the first one's words, less who said them, are the reason.
            raise AdapterError(re.sub(r"^(RankError: )?(rank \d+: )?", "", next(iter(e.failures.values())))) from None
        finally:
            self._loading.discard(name)
        self.numbers[name] = number
        log.info("adapter served", adapter=name, path=str(spec.path), format=spec.format, rank=spec.rank)

    async def unload(self, name: str) -> None:
        """Stop serving adapter ``name``; refused while a request queued or running uses it."""
        if name not in self.numbers:
            raise AdapterError(f"no adapter {name!r} is loaded; GET /v1/models lists them")
        number = self.numbers[name]
        if users := sum(seq.adapter == number for seq in self.requests()):
            raise AdapterError(f"adapter {name!r} serves {users} request(s) now; unload it once they have ended")
        del self.numbers[name]
        try:
            await self.pool.unload_adapter(number)
        except PoolError as e:  # the group was lost: the fresh one loads only the adapters still served
            raise Unavailable(f"not ready: {e}") from e
        log.info("adapter unloaded", adapter=name)
