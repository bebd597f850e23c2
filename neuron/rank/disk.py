"""A rank's prefix-cache entries on disk: its own shard of each entry the leader spills, one file per entry, read
back by a restarted server with the same model and layout.

Why a thread writes: an entry can hold gigabytes, and the step loop must not wait on a disk. The step only hands
the entry's arrays (computed already, never written to again) to the writer, which is bounded: past
``PENDING_BYTES`` waiting to be written, a spill is skipped with a warning rather than queued or waited for.

A file is ``MAGIC``, the length of a JSON header, the header, then each array's bytes. The header carries the
stamp (the model's digest and the layout, from the leader), the rank, the bits its keys and values were quantized to
(``--kv-bits``; null: not), the entry's key and length, each array's shape and dtype, and the sha256 of the bytes
after it. A file whose stamp, rank, bits or key is not this rank's, or whose bytes do not match its checksum
(corrupted, truncated), is skipped with a warning and never loaded. Past the byte
budget the oldest files go.
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

log = structlog.get_logger("neuron.rank")

MAGIC = b"NEURON-KV 1\n"
PENDING_BYTES = 1 << 30  # bytes handed to the writer and not yet written, at most
# The dtypes numpy has no type for travel as same-sized unsigned integers.
_AS_BITS = {mx.bfloat16: mx.uint16}
_DTYPES = {str(t): t for t in (mx.float32, mx.float16, mx.bfloat16, mx.uint32)}

Stored = mx.array | tuple[mx.array, mx.array, mx.array]  # keys or values: plain, or quantized (``rank.quantized``)
KeysValues = tuple[Stored, Stored]  # a plain layer's, each [1, kv heads here, tokens, head dim or its packing]


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
        self._queue: queue.Queue[tuple[str, int, list[mx.array], list[str], int] | None] = queue.Queue()
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

    def load(self, key: str) -> tuple[int, list[KeysValues]]:
        """The entry saved under ``key``: its length and each layer's keys and values; ``DiskError`` when its file
        must not be loaded."""
        path = self.path(key)
        header, offset = _header(path, self.stamp, self.rank, self.kv_bits)
        if header["key"] != key:
            raise DiskError(f"{path} holds entry {header['key']}, not {key}")
        data = path.read_bytes()[offset:]
        if hashlib.sha256(data).hexdigest() != header["sha256"]:
            raise DiskError(f"{path}: its bytes do not match its checksum (corrupted or truncated)")
        arrays, at = [], 0
        for shape, dtype in header["arrays"]:
            kind = _DTYPES.get(dtype)
            if kind is None:
                raise DiskError(f"{path}: unknown dtype {dtype}")
            bits = _AS_BITS.get(kind, kind)
            size = int(np.prod(shape)) * bits.size
            if at + size > len(data):
                raise DiskError(f"{path} is truncated")
            raw = np.frombuffer(data, dtype=np.dtype(str(bits).split(".")[-1]), count=size // bits.size, offset=at)
            array = mx.array(raw.reshape(shape))
            arrays.append(array.view(kind) if bits is not kind else array)
            at += size
        per_layer = 2 if self.kv_bits is None else 6  # keys and values, or each's packed values, scales and biases
        if at != len(data) or len(arrays) % per_layer:
            raise DiskError(f"{path}: its header does not describe its bytes")
        mx.eval(arrays)
        return int(header["tokens"]), [_layer(arrays[i : i + per_layer]) for i in range(0, len(arrays), per_layer)]

    def spill(self, key: str, tokens: int, layers: list[KeysValues]) -> None:
        """Hand an entry to the writer; skipped, with a warning, while the writer is too far behind."""
        flat = [a for layer in layers for held in layer for a in (held if isinstance(held, tuple) else (held,))]
        as_bits = [a.view(_AS_BITS[a.dtype]) if a.dtype in _AS_BITS else a for a in flat]
        mx.eval(as_bits)  # the views are built on this thread, whose stream MLX owns; the writer only reads bytes
        size = sum(a.nbytes for a in as_bits)
        with self._lock:
            if self._pending + size > PENDING_BYTES:
                self.skipped += 1
                log.warning("prefix cache spill skipped: the disk writer is behind", key=key, bytes=size)
                return
            self._pending += size
        self._queue.put((key, tokens, as_bits, [str(a.dtype) for a in flat], size))

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
            key, tokens, layers, dtypes, size = item
            try:
                self._write(key, tokens, layers, dtypes)
                self._trim()
            except OSError as e:
                log.warning("prefix cache spill failed", key=key, reason=str(e))
            finally:
                with self._lock:
                    self._pending -= size

    def _write(self, key: str, tokens: int, arrays: list[mx.array], dtypes: list[str]) -> None:
        chunks = [memoryview(np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8).data) for a in arrays]
        digest = hashlib.sha256()
        for chunk in chunks:
            digest.update(chunk)
        header: dict[str, Any] = {
            "stamp": self.stamp,
            "rank": self.rank,
            "kv_bits": self.kv_bits,
            "key": key,
            "tokens": tokens,
            "arrays": [[list(a.shape), dtype] for a, dtype in zip(arrays, dtypes, strict=True)],
            "sha256": digest.hexdigest(),
        }
        encoded = json.dumps(header).encode()
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


def _layer(arrays: list[mx.array]) -> KeysValues:
    """One layer's keys and values from its arrays as written: two, or three each where quantized."""
    if len(arrays) == 2:
        return arrays[0], arrays[1]
    return (arrays[0], arrays[1], arrays[2]), (arrays[3], arrays[4], arrays[5])


def _header(path: Path, stamp: str, rank: int, kv_bits: int | None) -> tuple[dict[str, Any], int]:
    """A file's header, checked against this rank's stamp and KV bits, and where its arrays start."""
    with path.open("rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise DiskError(f"{path} is not a neuron prefix-cache file")
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length < 1 << 24:
            raise DiskError(f"{path} has a damaged header")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DiskError(f"{path} has a damaged header: {e}") from None
    if not isinstance(header, dict) or not {"stamp", "rank", "key", "tokens", "arrays", "sha256"} <= set(header):
        raise DiskError(f"{path} has a damaged header")
    if header["stamp"] != stamp or header["rank"] != rank:
        raise DiskError(f"{path} was written for another model or layout ({header['stamp']}, rank {header['rank']})")
    if header.get("kv_bits") != kv_bits:  # a file from before the field held unquantized keys and values
        written, serving = (f"{bits} bits" if bits else "unquantized" for bits in (header.get("kv_bits"), kv_bits))
        raise DiskError(f"{path} holds a KV cache of {written} (--kv-bits), and this server keeps {serving}")
    return header, len(MAGIC) + 8 + length
