"""A rank's prefix-cache entries on disk: its own part of each entry the leader spills, one file per entry, read
back by a restarted server with the same model and layout.

Why a thread writes: an entry can hold gigabytes, and the step loop must not wait on a disk. The step only hands
the entry's arrays (computed already, never written to again) to the writer, which is bounded: past
``PENDING_BYTES`` waiting to be written, a spill is skipped with a warning rather than queued or waited for.

An entry's layers are written as mlx-lm's ``save_prompt_cache`` writes a prompt cache: each layer's ``state``
flattened (``mlx.utils.tree_flatten``), its arrays as bytes, its scalars (a rotating cache's offset and window, a
name) in the header, and each layer's kind, which ``from_state`` rebuilds it from. A plain layer's kept keys and
values (each quantized, as packed values, scales and biases, with ``--kv-bits``) are the kind ``keys/values``; a
snapshot (a sliding window's rotating cache, a linear-attention state) is its mlx-lm cache kind, one of ``KINDS``.

A file is ``MAGIC``, the length of a JSON header, the header, then each array's bytes. The header carries the
stamp (the model's digest and the layout, from the leader), the rank, the bits its keys and values were quantized to
(``--kv-bits``; null: not), the entry's key and length, each layer's kind, each array's path in the states, shape
and dtype, the scalars, and the sha256 of the rest of the header and the bytes after it. A file whose stamp, rank,
bits or key is not this rank's, whose format is another (``MAGIC``), or whose header or bytes do not match its
checksum (corrupted, truncated), is skipped with a warning and never loaded. Past the byte budget the oldest
files go.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import structlog
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_lm_cache

log = structlog.get_logger("neuron.rank")

# A file of another format (1: plain keys and values only, no kinds) is skipped as foreign, never misread.
FORMAT = 2
_NAME = b"NEURON-KV "
MAGIC = _NAME + f"{FORMAT}\n".encode()
PENDING_BYTES = 1 << 30  # bytes handed to the writer and not yet written, at most
# The dtypes numpy has no type for travel as same-sized unsigned integers.
_AS_BITS = {mx.bfloat16: mx.uint16}
_DTYPES = {
    str(t): t for t in (mx.float32, mx.float16, mx.bfloat16, mx.uint32, mx.int32, mx.int64, mx.uint8, mx.int8, mx.bool_)
}
KEYS_VALUES = "keys/values"  # a plain layer's kept keys and values: no mlx-lm cache, the tuple itself
# The caches a snapshot may hold, by the name a file gives them: mlx-lm's one-sequence kinds (a file names only
# these, so loading one never reaches anything else by name).
KINDS = {
    kind.__name__: kind
    for kind in (
        mlx_lm_cache.KVCache,
        mlx_lm_cache.QuantizedKVCache,
        mlx_lm_cache.RotatingKVCache,
        mlx_lm_cache.ArraysCache,
        mlx_lm_cache.CacheList,
    )
}
_SCALARS = (int, float, bool, str, type(None))

Stored = mx.array | tuple[mx.array, mx.array, mx.array]  # keys or values: plain, or quantized (``rank.kv.quantized``)
KeysValues = tuple[Stored, Stored]  # a plain layer's, each [1, kv heads here, tokens, head dim or its packing]
Layer = Any  # an entry's layer: ``KeysValues``, or a snapshot, one of ``KINDS``


class DiskError(ValueError):
    """A file that must not be loaded: the message says which and why."""


class Disk:
    def __init__(self, folder: Path, budget: int, stamp: str, rank: int, kv_bits: int | None = None) -> None:
        self.folder = folder
        self.budget = budget
        self.stamp = stamp
        self.rank = rank
        self.kv_bits = kv_bits
        folder.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue[tuple[str, dict[str, Any], list[mx.array], int] | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self.skipped = 0  # spills given up because the writer was behind
        self._thread = threading.Thread(target=self._write_all, name=f"neuron-kv-writer-{rank}", daemon=True)
        self._thread.start()

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.r{self.rank}.kv"

    def scan(self) -> dict[str, int]:
        """Each file of this rank's that may be loaded: its key and length (its bytes are checked on loading)."""
        out = {}
        for path in sorted(self.folder.glob(f"*.r{self.rank}.kv")):
            try:
                header, _ = _header(path, self.stamp, self.rank, self.kv_bits)
            except (DiskError, OSError) as e:
                log.warning("prefix cache file skipped", path=str(path), reason=str(e))
                continue
            out[header["key"]] = int(header["tokens"])
        return out

    def load(self, key: str) -> tuple[int, list[Layer]]:
        """The entry saved under ``key``: its length and each layer (keys and values, or a snapshot); ``DiskError``
        when its file must not be loaded."""
        path = self.path(key)
        header, offset = _header(path, self.stamp, self.rank, self.kv_bits)
        if header["key"] != key:
            raise DiskError(f"{path} holds entry {header['key']}, not {key}")
        data = path.read_bytes()[offset:]
        if _digest(header, [memoryview(data)]) != header["sha256"]:
            raise DiskError(f"{path}: its header or bytes do not match its checksum (corrupted or truncated)")
        try:
            return int(header["tokens"]), _layers(header["kinds"], _leaves(header, data))
        except (LookupError, TypeError, ValueError, AttributeError) as e:
            raise DiskError(f"{path}: its header does not describe its layers ({e})") from None

    def spill(self, key: str, tokens: int, layers: list[Layer]) -> None:
        """Hand an entry to the writer; skipped, with a warning, while the writer is too far behind or where a
        layer is of a kind no file holds."""
        try:
            kinds, leaves = _flat(layers)
        except DiskError as e:
            log.warning("prefix cache spill skipped", key=key, reason=str(e))
            return
        flat = [(where, a) for where, a in leaves if isinstance(a, mx.array)]
        as_bits = [a.view(_AS_BITS[a.dtype]) if a.dtype in _AS_BITS else a for _, a in flat]
        mx.eval(as_bits)  # the views are built on this thread, whose stream MLX owns; the writer only reads bytes
        size = sum(a.nbytes for a in as_bits)
        with self._lock:
            if self._pending + size > PENDING_BYTES:
                self.skipped += 1
                log.warning("prefix cache spill skipped: the disk writer is behind", key=key, bytes=size)
                return
            self._pending += size
        header: dict[str, Any] = {
            "stamp": self.stamp,
            "rank": self.rank,
            "kv_bits": self.kv_bits,
            "key": key,
            "tokens": tokens,
            "kinds": kinds,
            "arrays": [[where, list(a.shape), str(a.dtype)] for where, a in flat],
            "scalars": {where: value for where, value in leaves if not isinstance(value, mx.array)},
        }
        self._queue.put((key, header, as_bits, size))

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every spill handed over to be written; True if all were."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._pending == 0 and self._queue.empty():
                    return True
            time.sleep(0.01)
        return False

    def _write_all(self) -> None:
        while (item := self._queue.get()) is not None:
            key, header, arrays, size = item
            try:
                self._write(key, header, arrays)
                self._trim()
            except OSError as e:
                log.warning("prefix cache spill failed", key=key, reason=str(e))
            finally:
                with self._lock:
                    self._pending -= size

    def _write(self, key: str, header: dict[str, Any], arrays: list[mx.array]) -> None:
        chunks = [memoryview(np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8).data) for a in arrays]
        encoded = json.dumps({**header, "sha256": _digest(header, chunks)}).encode()
        path = self.path(key)
        partial = path.with_suffix(".partial")
        with partial.open("wb") as f:
            f.write(MAGIC + len(encoded).to_bytes(8, "little") + encoded)
            for chunk in chunks:
                f.write(chunk)
        os.replace(partial, path)  # a reader never sees half a file under the entry's name

    def _trim(self) -> None:
        """Delete the oldest of this rank's files while they hold more than the budget."""
        files = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.folder.glob(f"*.r{self.rank}.kv")]
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.budget:
                break
            path.unlink(missing_ok=True)
            total -= size

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout=1.0)


def _flat(layers: list[Layer]) -> tuple[list[str], list[tuple[str, Any]]]:
    """Each layer's kind, and the leaves of their states as mlx-lm's ``save_prompt_cache`` flattens them: arrays
    and scalars by their path; ``DiskError`` for a layer of a kind no file holds."""
    kinds = []
    for layer in layers:
        kind = KEYS_VALUES if isinstance(layer, tuple) else type(layer).__name__
        if kind != KEYS_VALUES and KINDS.get(kind) is not type(layer):
            raise DiskError(f"a layer's cache is a {kind}, which no prefix-cache file holds")
        kinds.append(kind)
    leaves: list[tuple[str, Any]] = []
    tree_flatten([layer if isinstance(layer, tuple) else layer.state for layer in layers], destination=leaves)
    for where, value in leaves:
        if not isinstance(value, (mx.array, *_SCALARS)):
            raise DiskError(f"a layer's state holds a {type(value).__name__} at {where}, which no file holds")
        if isinstance(value, str) and value not in KINDS:  # a cache list names its caches' kinds
            raise DiskError(f"a layer's state names {value!r}, which no prefix-cache file holds")
    return kinds, leaves


def _leaves(header: dict[str, Any], data: bytes) -> list[tuple[str, Any]]:
    """The states' leaves a file holds, by their path: its arrays, read from ``data``, and its scalars."""
    leaves: list[tuple[str, Any]] = []
    at = 0
    for where, shape, dtype in header["arrays"]:
        kind = _DTYPES[dtype]
        bits = _AS_BITS.get(kind, kind)
        size = int(np.prod(shape)) * bits.size
        if at + size > len(data):
            raise ValueError("its arrays run past its bytes")
        raw = np.frombuffer(data, dtype=np.dtype(str(bits).split(".")[-1]), count=size // bits.size, offset=at)
        array = mx.array(raw.reshape(shape))
        leaves.append((where, array.view(kind) if bits is not kind else array))
        at += size
    if at != len(data):
        raise ValueError("bytes are left past its arrays")
    mx.eval([array for _, array in leaves])
    return [*leaves, *header["scalars"].items()]


def _layers(kinds: list[str], leaves: list[tuple[str, Any]]) -> list[Layer]:
    """The layers ``_flat`` took apart, rebuilt: keys and values as tuples, any other cache by its kind's
    ``from_state``."""
    for _, value in leaves:
        if isinstance(value, str) and value not in KINDS:
            raise ValueError(f"a cache list names {value!r}")
    states = tree_unflatten(leaves)
    if not isinstance(states, list) or len(states) != len(kinds):
        raise ValueError(f"{len(kinds)} layers named, other states held")
    out: list[Layer] = []
    for kind, state in zip(kinds, states, strict=True):
        if kind == KEYS_VALUES:
            keys, values = (tuple(held) if isinstance(held, list) else held for held in state)
            out.append((keys, values))
        else:
            out.append(KINDS[kind].from_state(state))
    return out


def _digest(header: dict[str, Any], chunks: list[memoryview]) -> str:
    """The sha256 of a header (all but this digest) and of the bytes after it."""
    digest = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode())
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def _header(path: Path, stamp: str, rank: int, kv_bits: int | None) -> tuple[dict[str, Any], int]:
    """A file's header, checked against this rank's stamp and KV bits, and where its arrays start."""
    with path.open("rb") as f:
        magic = f.read(len(MAGIC))
        if magic != MAGIC:
            if magic.startswith(_NAME):
                written = magic.removeprefix(_NAME).strip().decode(errors="replace")
                theirs = f"format {written} of neuron's prefix-cache files, not this neuron's {FORMAT}"
                raise DiskError(f"{path} is in {theirs}")
            raise DiskError(f"{path} is not a neuron prefix-cache file")
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length < 1 << 24:
            raise DiskError(f"{path} has a damaged header")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DiskError(f"{path} has a damaged header: {e}") from None
    fields = {"stamp", "rank", "key", "tokens", "kinds", "arrays", "scalars", "sha256"}
    if not isinstance(header, dict) or not fields <= set(header) or not isinstance(header["scalars"], dict):
        raise DiskError(f"{path} has a damaged header")
    if header["stamp"] != stamp or header["rank"] != rank:
        raise DiskError(f"{path} was written for another model or layout ({header['stamp']}, rank {header['rank']})")
    if header.get("kv_bits") != kv_bits:
        written, serving = (f"{bits} bits" if bits else "unquantized" for bits in (header.get("kv_bits"), kv_bits))
        raise DiskError(f"{path} holds a KV cache of {written} (--kv-bits), and this server keeps {serving}")
    return header, len(MAGIC) + 8 + length
