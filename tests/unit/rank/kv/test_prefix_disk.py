"""The prefix cache's disk tier (``--prefix-cache-dir``): each rank's files checked directly (a real writer thread,
real files, no process), snapshots among them, and the leader's index of them within the byte budget. Real
servers restarted on their folder: tests/e2e/caching/test_prefix_disk.py."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from neuron.rank.kv.disk import MAGIC, Disk, DiskError

STAMP = "model/world 2/layers []"


def _layers(tokens: int, dtype: mx.Dtype = mx.float32) -> list[tuple[mx.array, mx.array]]:
    keys = mx.arange(2 * tokens * 4, dtype=mx.float32).reshape(1, 2, tokens, 4).astype(dtype)
    return [(keys, keys + 1), (keys * 2, keys - 1)]


def _written(folder: Path, key: str = "k1", tokens: int = 5, dtype: mx.Dtype = mx.float32, rank: int = 1) -> Disk:
    disk = Disk(folder, 1 << 20, STAMP, rank)
    disk.spill(key, tokens, _layers(tokens, dtype))
    assert disk.flush(10.0)
    return disk


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_a_spilled_entry_reads_back_as_it_was(tmp_path: Path, dtype: mx.Dtype) -> None:
    disk = _written(tmp_path, dtype=dtype)
    assert disk.scan() == {"k1": 5} and (tmp_path / "k1.r1.kv").exists()
    tokens, layers = disk.load("k1")
    assert tokens == 5
    for (keys, values), (want_keys, want_values) in zip(layers, _layers(5, dtype), strict=True):
        assert keys.dtype == dtype and mx.array_equal(keys, want_keys) and mx.array_equal(values, want_values)
    disk.close(1.0)


def test_a_corrupted_truncated_or_foreign_file_is_skipped_and_never_loaded(tmp_path: Path) -> None:
    disk = _written(tmp_path)
    path = tmp_path / "k1.r1.kv"
    whole = path.read_bytes()
    path.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))  # one bit of the keys and values flipped
    with pytest.raises(DiskError, match="checksum"):
        disk.load("k1")
    path.write_bytes(whole[: len(whole) // 2])  # truncated
    with pytest.raises(DiskError, match=r"checksum|truncated"):
        disk.load("k1")
    path.write_bytes(whole)
    assert disk.load("k1")[0] == 5
    assert Disk(tmp_path, 1 << 20, "another model/world 2/layers []", 1).scan() == {}  # another model or layout
    assert Disk(tmp_path, 1 << 20, STAMP, 0).scan() == {}  # rank 0 does not read rank 1's files
    (tmp_path / "k2.r1.kv").write_bytes(b"not a neuron file")
    (tmp_path / "k3.r1.kv").write_bytes(MAGIC + (5).to_bytes(8, "little") + b"{bad}")
    (tmp_path / "k4.r1.kv").write_bytes(b"NEURON-KV 1\n" + whole[len(MAGIC) :])  # the format before snapshots
    assert disk.scan() == {"k1": 5}  # all three skipped
    with pytest.raises(DiskError, match="format 1 of neuron's prefix-cache files, not this neuron's 2"):
        Disk(tmp_path, 1 << 20, STAMP, 1).load("k4")
    disk.close(1.0)


def _snapshot(tokens: int) -> list[object]:
    """A sliding-window model's and a linear-attention model's layers as an entry keeps them: a rotating cache fed
    past its window (its buffer wrapped), a state of two arrays, and a plain layer's keys and values."""
    mx.random.seed(0)
    window = RotatingKVCache(max_size=4)
    for _ in range(tokens):  # one token at a time: the buffer fills, then is written over from its start
        window.update_and_fetch(mx.random.normal((1, 2, 1, 8)).astype(mx.bfloat16), mx.random.normal((1, 2, 1, 8)))
    state = ArraysCache(size=2)
    state[0], state[1] = mx.random.normal((1, 3, 16)).astype(mx.bfloat16), mx.random.normal((1, 2, 4, 4))
    return [window, state, _layers(tokens)[0]]


def test_a_snapshot_entry_reads_back_as_mlx_lms_caches_and_a_changed_scalar_fails_its_checksum(tmp_path: Path) -> None:
    disk = Disk(tmp_path, 1 << 20, STAMP, 1)
    disk.spill("snap", 7, _snapshot(7))
    assert disk.flush(10.0) and disk.scan() == {"snap": 7}
    tokens, (window, state, (keys, values)) = disk.load("snap")
    want_window, want_state, (want_keys, want_values) = _snapshot(7)
    assert tokens == 7 and type(window) is RotatingKVCache and type(state) is ArraysCache
    assert (window.offset, window.keep, window.max_size, window._idx) == (7, 0, 4, 3)
    assert window.keys.dtype == mx.bfloat16 and mx.array_equal(window.keys, want_window.keys)
    assert mx.array_equal(window.values, want_window.values)
    assert state.left_padding is None and state.lengths is None
    assert all(mx.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(state.cache, want_state.cache, strict=True))
    assert mx.array_equal(keys, want_keys) and mx.array_equal(values, want_values)
    # The next token attends as it would have: the window goes on wrapping where it left off.
    step = mx.ones((1, 2, 1, 8))
    for got, want in zip(window.update_and_fetch(step, step), want_window.update_and_fetch(step, step), strict=True):
        assert mx.array_equal(got, want)
    # The header is under the checksum too: a rotating cache's write position changed by one digit is never loaded.
    path = tmp_path / "snap.r1.kv"
    whole = path.read_bytes()
    assert b'"0.5": 3' in whole
    path.write_bytes(whole.replace(b'"0.5": 3', b'"0.5": 2'))
    with pytest.raises(DiskError, match="checksum"):
        disk.load("snap")
    disk.close(1.0)


def test_the_oldest_files_go_past_the_byte_budget(tmp_path: Path) -> None:
    size = len((_written(tmp_path / "one").path("k1")).read_bytes())
    disk = Disk(tmp_path, 2 * size, STAMP, 1)
    for key in ("a", "b", "c"):
        disk.spill(key, 5, _layers(5))
        assert disk.flush(10.0)
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == ["b.r1.kv", "c.r1.kv"]
    disk.close(1.0)


def test_the_leaders_index_of_entries_on_disk_keeps_within_the_byte_budget(tmp_path: Path) -> None:
    from neuron.engine.prefix_disk import PrefixDisk

    disk = PrefixDisk(tmp_path, budget=10, sizes=(1, 0))  # as the ranks' files: 1 byte a token here
    disk.written({"a": [1, 2, 3, 4, 5, 6]})
    disk.written({"b": [7, 8, 9, 10, 11, 12]})  # past the budget: the older goes, as the ranks' oldest file does
    disk.written({"c": [7, 8, 9]})  # covered by b: b serves it
    assert disk._keys == {2: "b"} and disk._known.reach([1, 2, 3, 4]) == 0 and disk._known.reach([7, 8, 9, 0]) == 3
    disk.close()
    # Snapshots (a sliding window, a linear-attention state) are read back whole, as memory restores them.
    snapshots = PrefixDisk(tmp_path, budget=10, sizes=(1, 0), exact=True)
    snapshots.written({"a": [1, 2, 3, 4, 5, 6]})
    assert snapshots._known.reach([1, 2, 3, 4, 0]) == 0 and snapshots._known.reach([1, 2, 3, 4, 5, 6, 0]) == 6
    snapshots.close()
