"""A micro-batch of one row builds no attention mask for its one-token steps, as a plain cache builds none.

No model: mlx-lm's batched caches as ``rank.kv.batch`` joins, extends and filters them, and the mask each would
hand the model.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from neuron.rank.kv.batch import Batch


def _own(tokens: int) -> list[KVCache]:
    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 2, tokens, 4)), mx.ones((1, 2, tokens, 4)))
    return [cache]


def test_one_row_alone_is_unmasked_until_a_row_joins_and_again_once_it_leaves() -> None:
    batch = Batch()
    batch.join(0, [1], [_own(5)])
    layer = batch.micro_batches[0].cache[0]
    assert type(layer) is BatchKVCache  # still mlx-lm's own kind, as rollback and the prefix cache ask
    assert layer.make_mask(1) is None
    assert layer.make_mask(3).shape[-1] == 8  # a draft's tokens still see only what precedes them
    assert layer.make_mask(1, return_array=True) is not None

    batch.join(0, [2], [_own(2)])  # the shorter row is left-padded: its mask hides the padding
    mask = layer.make_mask(1)
    assert mask is not None and mask.tolist()[1][0][0][:3] == [False, False, False]

    batch.leave({1})  # the filter drops the padding the rows left share
    assert layer.left_padding.tolist() == [0]
    assert layer.make_mask(1) is None


def test_rows_joining_together_are_masked() -> None:
    batch = Batch()
    batch.join(0, [1, 2], [_own(5), _own(2)])
    assert batch.micro_batches[0].cache[0].make_mask(1) is not None
