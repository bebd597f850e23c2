"""Whether a quantized model can be split over the ranks (``rank.model.share.check_splittable``): a layer whose
inputs a tensor-parallel split cuts (the attention's output projection, the MLP's down projection) must leave each
rank whole quantization groups, and the refusal names the splits that would. The split itself, served:
tests/e2e/quantized/test_serving.py."""

from __future__ import annotations

import pytest

from neuron.models.folder import ModelError
from neuron.rank.model.share import check_splittable

LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
}


def test_a_split_that_cuts_a_quantization_group_is_refused_naming_the_splits_that_fit() -> None:
    quantized = {**LLAMA, "quantization": {"group_size": 128, "bits": 4}}
    for world_size in (1, 2, 4):  # 512 / 4 = 128 inputs each: a whole group
        check_splittable(quantized, world_size)
    with pytest.raises(ModelError) as refused:
        check_splittable(quantized, 8)
    said = str(refused.value)
    assert "groups of 128" in said and "attention output's 512 inputs" in said and "64 to each" in said
    assert "use --tp with one of [1, 2, 4]" in said


def test_an_unquantized_model_or_a_layer_too_narrow_to_quantize_splits_as_before() -> None:
    check_splittable(LLAMA, 8)
    # mlx_lm.convert leaves a layer whose width the group does not divide unquantized: it splits as it is.
    check_splittable({**LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                      "num_key_value_heads": 3, "quantization": {"group_size": 128, "bits": 4}}, 3)  # fmt: skip
