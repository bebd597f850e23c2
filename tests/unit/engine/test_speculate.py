"""Speculative decoding without a draft model, the decisions: the proposer follows a matching prediction, then
looks up and rests after misses; rows of a batch drop different draft tails as mlx-lm's right padding does.
Lossless on real servers: tests/e2e/speculation/test_speculate.py."""

from __future__ import annotations

from neuron.engine.drafts import Proposer, lookup


def test_the_proposer_follows_a_matching_prediction_then_looks_up_and_rests_after_misses() -> None:
    proposer = Proposer(prediction=[5, 6, 7, 8, 9, 10], limit=8)
    assert proposer.propose([1], [5], room=10) == [6, 7, 8, 9]  # the prediction after the output so far
    assert proposer.propose([1], [5, 6, 7, 8, 9], room=1) == [10]  # max_tokens leaves room for 1
    assert lookup([1, 2, 3, 4, 1, 2, 3], 3, [9, 1, 2, 3]) == [4, 1, 2]  # the 3-gram's last earlier occurrence
    assert lookup([1, 2, 3], 3, [7, 8]) == []
    # Off the prediction, the output's own rewrite (1 2 3 -> 5) beats the prediction's original (1 2 3 -> 4).
    rewriting = Proposer(prediction=[7, 1, 2, 3, 4], limit=8)
    output = [1, 2, 3, 5, 6, 1, 2, 3]
    assert rewriting.propose([0, 1, 2, 3, 4], output, room=10) == [5, 6, 1, 2]
    assert rewriting.propose([0, 1, 2, 3, 4], [8, 1, 2, 3], room=10) == [4]  # only the prediction has it
    chat = Proposer()
    chat.update(4, 4)
    assert chat.k == 8  # a whole draft kept: k grows
    for _ in range(3):
        chat.update(chat.k, 0)
    assert chat.resting > 0 and chat.propose([1, 2, 1, 2], [1], room=9) == []  # resting: no draft, no cost


def test_dropping_different_tails_matches_mlx_lms_right_padding() -> None:
    """``drop_tail``'s row gather leaves every row's visible keys, values, offsets and padding as mlx-lm's own
    ``finalize`` (right padding rolled to the front) does, and the next write lands the same."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from neuron.rank.kv.rollback import drop_tail

    def caches() -> list[BatchKVCache]:
        mx.random.seed(0)
        out = []
        for _ in range(2):  # layers
            cache = BatchKVCache([2, 0, 1])
            cache.update_and_fetch(mx.random.normal((3, 2, 300, 8)), mx.random.normal((3, 2, 300, 16)))
            cache.update_and_fetch(mx.random.normal((3, 2, 5, 8)), mx.random.normal((3, 2, 5, 16)))
            out.append(cache)
        return out

    drops = [4, 1, 2]
    expected, ours = caches(), caches()
    for cache in expected:
        cache.trim(min(drops))
        cache.prepare(right_padding=[d - min(drops) for d in drops])
        cache.finalize()
    drop_tail(ours, drops)
    new = (mx.random.normal((3, 2, 2, 8)), mx.random.normal((3, 2, 2, 16)))
    for a, b in zip(expected, ours, strict=True):
        assert a.offset.tolist() == b.offset.tolist() and a.left_padding.tolist() == b.left_padding.tolist()
        visible = a.left_padding.tolist()
        for x, y in (
            *zip(a.keys_and_values(), b.keys_and_values(), strict=True),
            *zip(a.update_and_fetch(*new), b.update_and_fetch(*new), strict=True),
        ):
            for row, start in enumerate(visible):
                assert mx.array_equal(x[row, :, start:], y[row, :, start:]).item()
