"""Fused projections (neuron/rank/model/fuse.py): the same logits as the model as mlx-lm loads it, in no more memory.

Tolerance: bitwise with the reference BLAS the mlx wheel links (what this process
uses unless it was started with OpenBLAS preloaded). OpenBLAS picks a different
kernel for a wider product at some row counts (from 8 rows at one thread, 29 at
two), which reorders its sums: logits then differ by about 2e-6 of their scale,
as splitting a layer over ranks does. The bound below allows 1e-5 of the scale;
a wrong split misses it by orders of magnitude.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from neuron.rank.model import fuse
from neuron.rank.model.share import load_share, parameter_count
from neuron.system import cpu
from testkit import make_tiny_model


def _logits(model: nn.Module) -> list[mx.array]:
    """A two-row, 12-token prefill's logits, then three greedy decode steps' (the first row's tokens for both)."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([[(7 * i + 3) % 200 + 10 for i in range(12)], list(range(40, 52))]), cache=cache)]
    for _ in range(3):
        token = mx.argmax(out[-1][:1, -1], axis=-1)
        out.append(model(mx.stack([token, token]), cache=cache))
    mx.eval(out)
    return out


@pytest.fixture(scope="module")
def models(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llama and qwen3 (q and k norms, tied head) from conftest, and qwen2 for its q, k and v biases."""
    return {**tiny_models, "qwen2": make_tiny_model(tmp_path_factory.mktemp("fuse") / "qwen2", "qwen2")}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_fused_logits_equal_unfused(models: dict[str, Path], arch: str) -> None:
    plain, _ = load_model(models[arch], lazy=False)
    fused = load_share(models[arch], None)  # the serving path at TP=1: it fuses
    attention, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert isinstance(attention.q_proj, fuse.FusedLead) and isinstance(attention.v_proj, fuse.FusedFollower)
    assert isinstance(mlp.gate_proj, fuse.FusedLead) and isinstance(mlp.up_proj, fuse.FusedFollower)
    assert ("bias" in attention.k_proj) == (arch == "qwen2")
    bitwise = cpu.blas_in_use().startswith("reference")
    for want, got in zip(_logits(plain), _logits(fused), strict=True):
        assert want.shape == got.shape
        if bitwise:
            assert mx.array_equal(want, got)
        else:
            assert mx.abs(want - got).max().item() <= 1e-5 * mx.abs(want).max().item()


def test_a_follower_called_on_another_input_computes_its_own_product(models: dict[str, Path]) -> None:
    plain, _ = load_model(models["qwen2"], lazy=False)
    fused, _ = load_model(models["qwen2"], lazy=False)
    fuse.fuse_projections(fused)
    want, got = plain.model.layers[1].self_attn, fused.model.layers[1].self_attn
    x, y = mx.random.normal((2, 3, 256)), mx.random.normal((2, 3, 256))
    got.q_proj(x)  # the lead keeps k and v for x ...
    for name in ("v_proj", "k_proj"):  # ... which a model calling them on y, out of order, must not get
        assert mx.allclose(getattr(got, name)(y), getattr(want, name)(y), rtol=1e-6, atol=1e-6)
    assert mx.allclose(got.k_proj(x), want.k_proj(x), rtol=1e-6, atol=1e-6)


def test_fusing_holds_no_weight_twice(models: dict[str, Path]) -> None:
    model, _ = load_model(models["llama"], lazy=False)
    shapes = {name: v.shape for name, v in tree_flatten(model.parameters())}
    count = parameter_count(model)
    gc.collect()
    before = mx.get_active_memory()
    assert fuse.fuse_projections(model) == 2 * len(model.model.layers)
    gc.collect()
    assert mx.get_active_memory() <= before  # every projection's weight is a view of its group's one array
    assert {name: v.shape for name, v in tree_flatten(model.parameters())} == shapes
    assert parameter_count(model) == count


def test_quantized_projections_fuse_into_one_product_and_answer_as_before(models: dict[str, Path]) -> None:
    plain, _ = load_model(models["qwen2"], lazy=False)
    nn.quantize(plain, group_size=64, bits=4)
    fused, _ = load_model(models["qwen2"], lazy=False)
    nn.quantize(fused, group_size=64, bits=4)
    shapes = {name: v.shape for name, v in tree_flatten(fused.parameters())}
    gc.collect()
    before = mx.get_active_memory()
    assert fuse.fuse_projections(fused) == 2 * len(fused.model.layers)
    gc.collect()
    assert mx.get_active_memory() <= before  # the words, scales and biases are views of each group's arrays
    attention = fused.model.layers[0].self_attn
    assert isinstance(attention.q_proj, fuse.FusedLead) and isinstance(attention.q_proj._fused, nn.QuantizedLinear)
    assert (attention.k_proj.bits, attention.k_proj.group_size) == (4, 64)  # as a LoRA reads a quantized layer
    assert {name: v.shape for name, v in tree_flatten(fused.parameters())} == shapes
    for want, got in zip(_logits(plain), _logits(fused), strict=True):
        assert mx.abs(want - got).max().item() <= 1e-5 * mx.abs(want).max().item()


def test_projections_quantized_unlike_are_left_as_they_are(models: dict[str, Path]) -> None:
    model, _ = load_model(models["llama"], lazy=False)

    def unlike(bits: int) -> Callable[[str, nn.Module], bool]:  # v in 8 bits, the rest in 4
        return lambda path, m: hasattr(m, "to_quantized") and path.endswith("v_proj") == (bits == 8)

    nn.quantize(model, group_size=64, bits=8, class_predicate=unlike(8))
    nn.quantize(model, group_size=64, bits=4, class_predicate=unlike(4))
    assert fuse.fuse_projections(model) == len(model.model.layers)  # gate and up only: q and k differ from v
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
