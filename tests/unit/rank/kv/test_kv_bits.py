"""A quantized KV cache (``--kv-bits``), no model, no process: the batched cache checked against mlx-lm's own
one-sequence cache, the disk tier's files of it, and the bits and models refused. Real servers with quantized
caches: tests/e2e/caching/test_kv_bits.py."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

from neuron.cli.main import _parser
from neuron.config import sources
from neuron.models import architectures
from neuron.models.folder import KV_GROUP_SIZE
from neuron.rank.kv import caches, rollback
from neuron.rank.kv.disk import Disk, DiskError
from neuron.rank.kv.quantized import BatchQuantizedKVCache

HEADS, DIM = 2, 64


def _kv(rows: int, tokens: int, seed: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return mx.random.normal((rows, HEADS, tokens, DIM)), mx.random.normal((rows, HEADS, tokens, DIM))


def _alone(lengths: list[int], bits: int, seed: int) -> list[QuantizedKVCache]:
    out = []
    for i, n in enumerate(lengths):
        cache = QuantizedKVCache(KV_GROUP_SIZE, bits)
        cache.update_and_fetch(*_kv(1, n, seed + i))
        out.append(cache)
    return out


def _attend(cache: object, queries: mx.array, mask: mx.array | str | None) -> mx.array:
    keys, values = cache.keys_and_values()  # type: ignore[attr-defined]
    # mlx-lm's quantized attention scales the queries in place: each call gets its own.
    return scaled_dot_product_attention(queries + 0, keys, values, cache=cache, scale=DIM**-0.5, mask=mask)


def _same_rows(batch: BatchQuantizedKVCache, alone: list[QuantizedKVCache], seed: int) -> None:
    """A decode step's token written to each row attends as it does written to the one-sequence cache alone, and
    then each row holds what that cache holds, bit for bit."""
    mask = batch.make_mask(1)
    keys, values = _kv(len(alone), 1, seed)
    batch.update_and_fetch(keys, values)
    queries = mx.random.normal((len(alone), HEADS * 2, 1, DIM))
    batched = _attend(batch, queries, mask)
    for i, one in enumerate(alone):
        one.update_and_fetch(keys[i : i + 1], values[i : i + 1])
        assert mx.allclose(batched[i : i + 1], _attend(one, queries[i : i + 1], None), atol=1e-5)
        row = batch.extract(i)
        assert row.offset == one.offset
        for mine, theirs in zip((*row.keys, *row.values), (*one.keys, *one.values), strict=True):
            assert mx.array_equal(mine, theirs[..., : one.offset, :])


@pytest.mark.parametrize("bits", [8, 4])
def test_the_batched_quantized_cache_holds_and_attends_as_mlx_lms_one_sequence_cache(bits: int) -> None:
    alone = _alone([5, 300, 17], bits, seed=1)
    batch = caches.merge([[c] for c in alone])[0]
    assert isinstance(batch, BatchQuantizedKVCache)
    _same_rows(batch, alone, seed=9)
    # Rows joining (extend), leaving (filter), and a draft's tail dropped by different amounts per row.
    joining = _alone([40, 2], bits, seed=20)
    batch.extend(caches.merge([[c] for c in joining])[0])
    alone += joining
    batch.filter([0, 2, 3, 4])
    alone = [alone[i] for i in (0, 2, 3, 4)]
    _same_rows(batch, alone, seed=10)
    rollback.drop_tail([batch], [0, 1, 2, 1])
    for one, drop in zip(alone, [0, 1, 2, 1], strict=True):
        one.trim(drop)
    _same_rows(batch, alone, seed=11)
    assert caches.cuttable([batch]) and isinstance(caches.copied([alone[0]])[0], QuantizedKVCache)


def test_new_prompts_get_a_quantized_padded_batch_where_the_model_keeps_quantized_caches() -> None:
    batch = caches.padded_batch([QuantizedKVCache(KV_GROUP_SIZE, 4)], [3, 0])
    assert isinstance(batch[0], BatchQuantizedKVCache) and batch[0].bits == 4
    batch[0].update_and_fetch(*_kv(2, 6, seed=3))
    assert batch[0].extract(0).offset == 3 and batch[0].extract(1).offset == 6


def _quantized_layers(tokens: int, bits: int) -> list[tuple[tuple[mx.array, ...], tuple[mx.array, ...]]]:
    keys, values = _kv(1, tokens, seed=5)
    return [(tuple(mx.quantize(keys, KV_GROUP_SIZE, bits)), tuple(mx.quantize(values, KV_GROUP_SIZE, bits)))] * 2


def test_a_quantized_entry_reads_back_from_disk_and_a_file_of_other_bits_is_foreign(tmp_path: Path) -> None:
    disk = Disk(tmp_path, 1 << 20, "stamp", 0, kv_bits=8)
    disk.spill("k", 5, _quantized_layers(5, 8))  # type: ignore[arg-type]
    assert disk.flush(10.0) and disk.scan() == {"k": 5}
    tokens, layers = disk.load("k")
    assert tokens == 5
    for got, want in zip(layers, _quantized_layers(5, 8), strict=True):
        for mine, theirs in zip((*got[0], *got[1]), (*want[0], *want[1]), strict=True):  # type: ignore[misc]
            assert mine.dtype == theirs.dtype and mx.array_equal(mine, theirs)
    for other in (Disk(tmp_path, 1 << 20, "stamp", 0, kv_bits=4), Disk(tmp_path, 1 << 20, "stamp", 0)):
        assert other.scan() == {}
        with pytest.raises(DiskError, match=r"holds a KV cache of 8 bits \(--kv-bits\), and this server keeps"):
            other.load("k")
        other.close(1.0)
    disk.close(1.0)


def test_bad_bits_and_models_whose_caches_cannot_be_quantized_are_refused() -> None:
    args = _parser().parse_args(["serve", "--kv-bits", "3"])
    assert sources.resolve(args, "serve") == [
        "--kv-bits must be 8 or 4 (bits per cached key and value), got 3; leave it unset to keep it unquantized"
    ]
    llama = {"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256}
    architectures.check_kv_bits(llama, 4, KV_GROUP_SIZE)  # heads of 64
    refusals = {
        "gemma3_text": "key/value \\+ sliding window ones",
        "qwen3_5": "linear-attention state ones",
        "deepseek_v3": "latent attention",
    }
    for arch, why in refusals.items():
        model = {**llama, "model_type": arch, "kv_lora_rank": 512 if arch == "deepseek_v3" else 0}
        with pytest.raises(architectures.Unsupported, match=f"--kv-bits 4: '{arch}' cannot .*{why}.*without --kv-bits"):
            architectures.check_kv_bits(model, 4, KV_GROUP_SIZE)
    with pytest.raises(architectures.Unsupported, match="heads are 40 wide"):
        architectures.check_kv_bits({**llama, "head_dim": 40}, 8, KV_GROUP_SIZE)
