"""The Qwen vision families' multimodal rotary positions (``engine.image_prompts``), no model: the rope index as
mlx-vlm computes it, the positions each chunk carries in the plan, and the table's rows. Served: tests/e2e/vision/
test_vision_qwen.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from neuron.engine.image_prompts import Rope, rope_index
from neuron.models import architectures


def test_the_rope_index_is_mlx_vlms_for_a_prompt_with_two_images() -> None:
    import mlx.core as mx
    from mlx_vlm.models.qwen3_vl.language import LanguageModel

    start, pad, end = 7, 9, 8
    # text, an image of 2 x 3 merged tokens, text, an image of 4 x 2, text
    ids = [1, 2, start, *[pad] * 6, end, 3, 4, 5, start, *[pad] * 8, end, 6]
    config = SimpleNamespace(
        vision_config=SimpleNamespace(spatial_merge_size=2),
        image_token_id=pad,
        video_token_id=99,
        vision_start_token_id=start,
    )
    positions, deltas = LanguageModel.get_rope_index(
        SimpleNamespace(config=config), mx.array([ids]), mx.array([[1, 4, 6], [1, 8, 4]])
    )
    rope = rope_index(ids, [(3, (1, 2, 3)), (14, (1, 4, 2))])
    assert [list(row) for row in rope.rows] == positions[:, 0, :].tolist()
    assert rope.delta == int(deltas[0, 0].item()) < 0


def test_a_chunk_carries_positions_only_where_they_are_not_plain() -> None:
    rope = rope_index([0] * 8, [(2, (1, 2, 2))])  # text at 0, 1; a 2 x 2 image at 2..5; text at 6, 7
    assert rope.chunk(0, 2) == []  # before the image: the plain positions
    assert rope.chunk(1, 4) == [[1, 2, 2], [1, 2, 2], [1, 2, 3]]
    assert rope.chunk(6, 8) == [[4, 5]] * 3 and rope.delta == -2
    # Past the prompt (a resumed sequence's output fed again): on from the prompt's last position.
    assert rope.chunk(7, 10) == [[5, 6, 7]] * 3
    assert Rope(((0, 1),) * 3, 0).chunk(0, 2) == []


def test_the_plan_carries_each_chunks_positions_and_the_decode_rows_lag() -> None:
    from testkit.scheduling import admitted, request, run, scheduler

    s = scheduler(prefill_chunk=4)
    seq = request(8)
    seq.rope = rope_index(seq.prompt, [(2, (1, 2, 2))])  # a 2 x 2 image at 2..5
    admitted(s, seq)
    first, second = run(s).prefill[0], run(s).prefill[0]
    assert first.positions == [[0, 1, 2, 2], [0, 1, 2, 2], [0, 1, 2, 3]]
    assert second.positions == [[2, 2, 4, 5], [3, 3, 4, 5], [2, 3, 4, 5]]
    assert [row.rope_delta for row in run(s).decode] == [-2]


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5", "qwen3_5_moe"])
def test_the_table_says_the_qwen_vision_language_models_take_images(arch: str) -> None:
    support = architectures.supports({"model_type": arch})
    assert support is not None and support.images and support.tp and support.pp
    rows = architectures.markdown().split("\n")
    assert any(line.startswith(f"| {arch} |") and line.endswith("| yes |") for line in rows)
