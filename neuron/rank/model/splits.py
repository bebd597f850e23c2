"""Tensor-parallel splits for the architectures mlx-lm has no ``shard()`` for, written as mlx-lm writes its
own (llama's): each rank keeps its heads' rows of the query, key and value projections and its rows of the MLP's
inner projections, and the output projections' matching columns sum over the group. mlx's sharding helpers
(``shard_linear``) do the slicing; what differs by architecture is named here.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear


def split(model: nn.Module, model_type: str, group: mx.distributed.Group) -> None:
    """Keep this rank's slice of every layer: by mlx-lm's ``shard()`` where it has one, else by neuron's plan
    (``neuron.models.architectures`` says which, and the leader checked before loading)."""
    if hasattr(model, "shard"):
        model.shard(group)
        return
    SPLITS[model_type](model, group)


def _mlp(mlp: nn.Module, group: mx.distributed.Group) -> None:
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def _attention(attn: nn.Module, group: mx.distributed.Group) -> None:
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.n_heads //= group.size()
    attn.n_kv_heads //= group.size()


def _granite(model: nn.Module, group: mx.distributed.Group) -> None:
    """llama's shape; its multipliers scale whole activations, the same on every rank."""
    for layer in model.model.layers:
        _attention(layer.self_attn, group)
        _mlp(layer.mlp, group)


def _phi3(model: nn.Module, group: mx.distributed.Group) -> None:
    """Fused projections, split piece by piece: each rank keeps its rows of the queries, of the keys and of the
    values in ``qkv_proj``, and of the gate and of the up projection in ``gate_up_proj``."""
    for layer in model.model.layers:
        attn = layer.self_attn
        queries, keys = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
        attn.qkv_proj = shard_linear(attn.qkv_proj, "all-to-sharded", segments=[queries, queries + keys], group=group)
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.n_heads //= group.size()
        attn.n_kv_heads //= group.size()
        layer.mlp.gate_up_proj = shard_linear(layer.mlp.gate_up_proj, "all-to-sharded", segments=2, group=group)
        layer.mlp.down_proj = shard_linear(layer.mlp.down_proj, "sharded-to-all", group=group)


class HeadsRMSNorm(nn.Module):
    """An RMS norm over all heads' features when each rank holds only its heads' (olmo2's ``q_norm`` and
    ``k_norm`` normalize the whole projection): the squares are summed over the group."""

    def __init__(self, norm: nn.RMSNorm, group: mx.distributed.Group) -> None:
        super().__init__()
        self.features = norm.weight.shape[0]
        self.weight = mx.split(norm.weight, group.size())[group.rank()]
        self.eps = norm.eps
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        squares = mx.distributed.all_sum(mx.sum(x.astype(mx.float32) ** 2, axis=-1, keepdims=True), group=self.group)
        return (x * mx.rsqrt(squares / self.features + self.eps)).astype(x.dtype) * self.weight


def _olmo2(model: nn.Module, group: mx.distributed.Group) -> None:
    for layer in model.model.layers:
        attn = layer.self_attn
        _attention(attn, group)
        attn.q_norm = HeadsRMSNorm(attn.q_norm, group)
        attn.k_norm = HeadsRMSNorm(attn.k_norm, group)
        _mlp(layer.mlp, group)


def _gemma(model: nn.Module, group: mx.distributed.Group) -> None:
    """gemma3's and gemma4's layers: per-head norms (nothing to gather); a gemma4 layer that reads another's keys
    and values has no key or value projection, and one whose keys are its values none for the values."""
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            if name in attn:
                setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.n_heads //= group.size()
        attn.n_kv_heads //= group.size()
        _mlp(layer.mlp, group)


def _qwen3_next(model: nn.Module, group: mx.distributed.Group) -> None:
    """Each rank keeps its key heads of the linear attention (with the value heads they lead), its heads of the
    full attention, and its slice of every expert and of the shared expert; the MoE block sums its output over
    the group itself (mlx-lm's ``sharding_group``), as qwen3_moe's ``shard()`` has it."""
    size = group.size()
    for layer in model.model.layers:
        if layer.is_linear:
            _linear_attention(layer.linear_attn, group)
        else:
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):  # q_proj holds each head's queries then its gate: by head
                setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
            attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
            attn.num_attention_heads //= size
            attn.num_key_value_heads //= size
        mlp = layer.mlp
        if "switch_mlp" not in mlp:
            _mlp(mlp, group)
            continue
        mlp.sharding_group = group
        for experts in (mlp.switch_mlp, mlp.shared_expert):
            shard_inplace(experts.gate_proj, "all-to-sharded", group=group)
            shard_inplace(experts.up_proj, "all-to-sharded", group=group)
            shard_inplace(experts.down_proj, "sharded-to-all", group=group)


def _linear_attention(net: nn.Module, group: mx.distributed.Group) -> None:
    """qwen3_next's gated delta net: its fused input projections are laid out key head by key head, so a
    contiguous slice of rows is a rank's heads; its convolution runs over the queries, keys and values side by
    side, so each of the three is split in turn."""
    size, rank = group.size(), group.rank()
    key_dim = net.key_dim
    net.in_proj_qkvz = shard_linear(net.in_proj_qkvz, "all-to-sharded", group=group)
    net.in_proj_ba = shard_linear(net.in_proj_ba, "all-to-sharded", group=group)
    shard_inplace(net.conv1d, lambda path, weight: (0, [key_dim, 2 * key_dim]), group=group)
    net.conv1d.groups //= size
    net.dt_bias = mx.contiguous(mx.split(net.dt_bias, size)[rank])
    net.A_log = mx.contiguous(mx.split(net.A_log, size)[rank])
    net.out_proj = shard_linear(net.out_proj, "sharded-to-all", group=group)
    net.num_k_heads //= size
    net.num_v_heads //= size
    net.key_dim //= size
    net.value_dim //= size
    net.conv_dim //= size


def _language_model(model: nn.Module, group: mx.distributed.Group) -> None:
    """A vision-language model whose language model is one mlx-lm splits (mistral3's llama, qwen3_vl's qwen3):
    the vision tower is rank 0's alone (``rank.model.vision``), and never part of this model."""
    model.language_model.shard(group)


def _gemma_language_model(model: nn.Module, group: mx.distributed.Group) -> None:
    """gemma3's and gemma4's vision-language models: the language model split as gemma3_text's and
    gemma4_text's (the vision tower, as above)."""
    _gemma(model.language_model, group)


SPLITS: dict[str, Callable[[nn.Module, mx.distributed.Group], None]] = {
    "mistral3": _language_model,
    "qwen3_vl": _language_model,
    "gemma3": _gemma_language_model,
    "gemma4": _gemma_language_model,
    "granite": _granite,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "gemma3_text": _gemma,
    "gemma4_text": _gemma,
    "qwen3_next": _qwen3_next,
}
