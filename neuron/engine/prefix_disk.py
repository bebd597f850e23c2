"""The prefix cache's second tier, as the leader runs it: which entries go to disk, and which come back when a
server starts with ``--prefix-cache-dir``.

Each rank writes its own part of a spilled entry (``neuron.rank.kv.disk``: its heads, or its stage's layers); the
leader writes a manifest beside rank 0's file, ``KEY.tokens``: the entry's token ids, which no rank knows. On a
start with the same model and layout, every rank lists the files it may load, the leader keeps the keys every rank
has (a manifest too), the newest first, as many as the memory budget holds, and every rank loads them; a key that
any rank fails to load (corrupted, truncated, missing there) is left out and the rest are loaded again, so the
ranks always hold the same entries.

While serving, the leader remembers every entry on disk (those found at the start, those spilled since) in an index
of its own. Before a request is admitted, when the disk holds more of its prompt than memory does, every rank
loads that entry again (it displaces the least recently used, evicted by the next plan, to disk in turn); a file
that some rank fails to load is dropped on every rank and forgotten, and the prompt is computed.
"""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path

import structlog

from neuron.engine.prefix import PrefixIndex, disk_key
from neuron.engine.sequence import Sequence
from neuron.models.folder import digest_files, model_digest
from neuron.pool import Pool, PoolError
from neuron.rpc import Evict, StepPlan
from neuron.step import Step

log = structlog.get_logger("neuron.engine")

LOAD_TRIES = 3  # rounds of loading, each without the keys some rank failed on in the last


class PrefixDisk:
    """The leader's side: manifests written off the step loop, and the start's and the shutdown's exchanges."""

    def __init__(self, folder: Path, budget: int, sizes: tuple[int, int] = (0, 0), exact: bool = False) -> None:
        self.folder = folder
        self.budget = budget
        folder.mkdir(parents=True, exist_ok=True)
        # Every entry on disk, as a trie of its own within the same byte budget as each rank's files (``sizes``: an
        # entry's bytes per token and its fixed bytes, the most any rank holds), and each one's key;
        # ``exact`` as the memory's index: snapshots (a sliding window, a linear-attention state) restore whole.
        self._known = PrefixIndex(budget, *sizes, exact=exact)
        self._keys: dict[int, str] = {}
        self._queue: queue.Queue[dict[str, list[int]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_all, name="neuron-kv-manifests", daemon=True)
        self._thread.start()

    @classmethod
    def opened(cls, folder: str, budget: int, cached: bool, exact: bool, sizes: tuple[int, int]) -> PrefixDisk | None:
        """The disk tier in ``folder``, or None with a warning where there is no prefix cache in memory (``cached``)
        to spill. ``exact``: the model's entries are snapshots (a sliding window or a linear-attention state),
        restored whole, from disk as from memory."""
        if cached:
            return cls(Path(folder), budget, sizes, exact)
        log.warning(
            "prefix cache disk tier off: nothing is written to --prefix-cache-dir",
            folder=folder,
            reason="--prefix-cache-bytes is 0: there is no prefix cache to spill",
        )
        return None

    def written(self, spilled: dict[str, list[int]]) -> None:
        """Entries a step spilled: their manifests are written by a thread of their own."""
        if spilled:
            self._queue.put(spilled)
            for key, tokens in spilled.items():
                self._know(key, tokens)

    def _know(self, key: str, tokens: list[int]) -> None:
        stored = self._known.store(tokens)
        if stored is not None:
            self._keys[stored.entry] = key
            for entry in stored.evicted:  # a shorter entry a longer one covers, or the oldest past the budget
                self._keys.pop(entry, None)

    async def reload(self, pool: Pool, prefix: PrefixIndex, admitting: list[Sequence]) -> None:
        """Before ``admitting`` are admitted: load each one's longest entry on disk where it holds more of the
        prompt than memory does (the base model's text prompts only: the files name no adapter, no image)."""
        for seq in admitting:
            if seq.fed or seq.images or seq.adapter or seq.pooling is not None or seq.params.prompt_logprobs:
                continue
            hit = self._known.lookup(seq.tokens)
            self._known.unpin()
            if hit is None or hit.tokens <= prefix.reach(seq.tokens):
                continue
            key = self._keys[hit.entry]
            tokens = self._known.tokens(hit.entry)
            stored = prefix.reload(tokens)
            if stored is None:
                continue
            await pool.flush_prefix_disk()  # a file spilled a moment ago may still be being written
            if await pool.load_prefixes({key: stored.entry}):
                await pool.load_prefixes({}, drop=[stored.entry])
                prefix.forget(stored.entry)
                self._known.forget(hit.entry)
                del self._keys[hit.entry]
                continue
            log.info("prefix cache entry read back from disk", key=key, tokens=len(tokens))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10.0)

    async def restore(self, pool: Pool, prefix: PrefixIndex) -> int:
        """Open every rank's folder and load what all of them hold; returns the tokens restored."""
        stamp = f"{model_digest(digest_files(pool.model_path))}/world {pool.world_size}/layers {pool.layers}"
        saved = await pool.open_prefix_disk(str(self.folder), self.budget, stamp)
        common = set.intersection(*(set(keys.items()) for keys in saved.values()))
        manifests = self._manifests()
        candidates = [(key, manifests[key]) for key, tokens in common if len(manifests.get(key, ())) == tokens]
        candidates.sort(key=lambda kv: -(self.folder / f"{kv[0]}.tokens").stat().st_mtime)
        for key, tokens in reversed(candidates):
            self._know(key, tokens)
        for _ in range(LOAD_TRIES):
            chosen = {key: entry for key, tokens in candidates if (entry := prefix.add(tokens)) is not None}
            failed = await pool.load_prefixes(chosen) if chosen else set()
            if not failed:
                restored = sum(len(tokens) for key, tokens in candidates if key in chosen)
                log.info("prefix cache restored from disk", entries=len(chosen), tokens=restored, stamp=stamp)
                return restored
            prefix.clear()
            await pool.clear_kv_cache(prefixes=True)
            candidates = [(key, tokens) for key, tokens in candidates if key not in failed]
        return 0

    async def spill_all(self, pool: Pool, prefix: PrefixIndex) -> None:
        """At shutdown: every entry to disk, and wait for the ranks' writers."""
        held = prefix.held()
        if held and pool.broken is None:
            spilled = {disk_key(tokens): tokens for tokens in held.values()}
            plan = StepPlan(evict=[Evict(entry, disk_key(tokens)) for entry, tokens in held.items()])
            try:
                await pool.step(Step(plan, {}, spilled))
                prefix.clear()
                self.written(spilled)
                if not await pool.flush_prefix_disk():
                    log.warning("prefix cache: not every entry was written to disk before the deadline")
            except PoolError as e:
                log.warning("prefix cache: entries not written to disk", reason=str(e))
        self.close()

    def _manifests(self) -> dict[str, list[int]]:
        out = {}
        for path in self.folder.glob("*.tokens"):
            key = path.stem
            try:
                tokens = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                log.warning("prefix cache manifest skipped", path=str(path), reason=str(e))
                continue
            if not (self.folder / f"{key}.r0.kv").exists():
                path.unlink(missing_ok=True)  # its entry's files went over the budget
            elif isinstance(tokens, list) and all(type(t) is int for t in tokens) and disk_key(tokens) == key:
                out[key] = tokens
            else:
                log.warning("prefix cache manifest skipped", path=str(path), reason="its tokens do not match its name")
        return out

    def _write_all(self) -> None:
        while (spilled := self._queue.get()) is not None:
            for key, tokens in spilled.items():
                try:
                    partial = self.folder / f"{key}.tokens.partial"
                    partial.write_text(json.dumps(tokens))
                    partial.replace(self.folder / f"{key}.tokens")
                except OSError as e:
                    log.warning("prefix cache manifest not written", key=key, reason=str(e))
