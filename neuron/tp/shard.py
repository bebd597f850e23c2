"""One rank's slice of a model: loaded with mlx-lm, split by its ``shard()`` (or neuron's plan, ``plans``), and
the vocabulary projection split too where that pays; and the check that a model can be split at all."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load_model

from neuron import architectures
from neuron.models import ModelError, text_config
from neuron.tp import plans, staged
from neuron.tp.fuse import fuse_projections


def check_splittable(config: dict, world_size: int, stages: int = 1) -> None:
    """Raise ``ModelError`` unless a model of this config can be split over ``world_size`` ranks, in ``stages``
    pipeline stages (tensor parallel over all of them when 1): what ``neuron.architectures`` says of it, then
    the shapes.

    The leader calls it once, before any rank is spawned: a model that cannot
    be split would otherwise fail on every rank at once, after each had spent
    the time (and memory) to read its weights.
    """
    try:
        model_class, _ = _get_classes(config)
    except ValueError as e:
        raise ModelError(f"mlx-lm does not support this architecture ({e})") from None
    try:
        support = architectures.check(config, world_size, stages)
    except architectures.Unsupported as e:
        raise ModelError(str(e)) from None
    if stages > 1:
        layers = int(text_config(config)["num_hidden_layers"])
        if layers < stages:
            raise ModelError(f"the model has {layers} layers, fewer than the {stages} pipeline stages asked for")
        return
    if world_size == 1:
        return
    arch = architectures.architecture(config)
    if support is None and not hasattr(model_class, "shard"):  # outside the table: as mlx-lm splits it
        raise ModelError(f"architecture {arch!r} has no tensor-parallel shard() in mlx-lm; serve it with --tp 1")
    text = text_config(config)
    vocab = text.get("vocab_size")
    split_head = arch == "qwen3_5" and not text.get("tie_word_embeddings", False)
    if split_head and isinstance(vocab, int) and vocab % world_size:  # its shard() splits the head by rows
        raise ModelError(
            f"{arch!r} splits its vocabulary of {vocab} over the ranks, and {world_size} does not divide it; "
            "use a --tp that divides it"
        )
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads", heads)
    global_kv_heads = text.get("num_global_key_value_heads")  # gemma4's full-attention layers
    for name, count in (
        ("attention heads", heads),
        ("key/value heads", kv_heads),
        ("global key/value heads", global_kv_heads),
    ):
        if isinstance(count, int) and count % world_size:
            fits = [n for n in range(1, count + 1) if count % n == 0 and (kv_heads or count) % n == 0]
            raise ModelError(
                f"{arch!r} has {count} {name}, which do not divide over {world_size} ranks; use --tp with one of {fits}"
            )


def backbone(model: nn.Module) -> nn.Module:
    """The model without its final projection to the vocabulary (the final norm included).

    Where the head is not split (``VocabShard``), workers run only this: mlx-lm's
    ``shard()`` replicates the head, and skipping it spares workers the largest
    single matrix product of a decode step, whose result only rank 0 would use.
    """
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) and hasattr(inner, "layers") else model


def head_gathers(model: nn.Module) -> bool:
    """Whether mlx-lm's ``shard()`` split the projection to the vocabulary, which then gathers its rows inside the
    model's own call (qwen3_5's, where the embedding is not tied)."""
    language = getattr(model, "language_model", model)
    return getattr(language, "sharding_group", None) is not None


# Architectures whose logits are exactly the head (or the tied embedding) applied to the backbone's output:
# nothing after it (no soft-capping, no scaling) that a split head would skip.
PLAIN_HEAD = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# A split head costs one all_gather per step and saves reading half the head on rank 0's core: on the 2-core
# development box it pays from about 5M fp32 parameters (BENCHMARKS.md, "When a split LM head pays"); 8M leaves
# a margin.
SPLIT_HEAD_MIN_PARAMS = 8_000_000


@dataclass(frozen=True, slots=True)
class VocabShard:
    """This rank's rows of the projection to the vocabulary; each rank projects onto its rows, then all gather.

    Why split what ``shard()`` replicates: on a CPU host the head is read once per
    token by rank 0 alone, on one core, and a large vocabulary's head is as big as
    several layers. Split, each rank reads its half at the same
    time, and one all_gather of B x vocab floats brings the logits together.
    """

    weight: mx.array  # (rows, hidden); the last rank's rows are padded with zeros to the same count
    vocab: int
    group: mx.distributed.Group

    def __call__(self, hidden: mx.array) -> mx.array:
        """(batch, hidden) -> (batch, vocab), on every rank."""
        local = hidden @ self.weight.T
        return mx.distributed.all_gather(local.T, group=self.group).T[:, : self.vocab]


def shard_head(model: nn.Module, model_type: str, group: mx.distributed.Group | None) -> VocabShard | None:
    """Split the vocabulary projection over the group, or None where it must stay whole on rank 0."""
    if group is None or group.size() == 1 or model_type not in PLAIN_HEAD:
        return None
    head = getattr(model, "lm_head", None)
    embedding = getattr(backbone(model), "embed_tokens", None)
    if type(head) is nn.Linear and "bias" not in head:
        weight = head.weight
    elif head is None and type(embedding) is nn.Embedding:
        weight = embedding.weight  # tied: the head is the embedding read backwards
    else:
        return None  # quantized, biased, or shaped otherwise: rank 0 keeps the whole head
    vocab, hidden = weight.shape
    if vocab * hidden < SPLIT_HEAD_MIN_PARAMS:
        return None
    rows = -(-vocab // group.size())
    mine = weight[group.rank() * rows : (group.rank() + 1) * rows]
    if mine.shape[0] < rows:
        mine = mx.concatenate([mine, mx.zeros((rows - mine.shape[0], hidden), dtype=mine.dtype)])
    mx.eval(mine)
    return VocabShard(mine, vocab, group)


def load_shard(model_path: str | Path, group: mx.distributed.Group | None) -> nn.Module:
    """Load the model lazily, keep this rank's slices, then materialize only those.

    One tensor at a time: evaluating a slice reads its whole tensor from disk,
    and evaluating every slice at once would hold every whole tensor at the
    same moment, a peak as large as the unsplit model on every rank.
    """
    model, config = load_model(Path(model_path), lazy=True)
    if group is not None and group.size() > 1:
        plans.split(model, config.get("model_type", ""), group)
    for parameter in _arrays(model):
        mx.eval(parameter)
    fuse_projections(model)  # after the split: each rank fuses its own slices (its heads' rows of q, k, v)
    return model


def load_stage(model_path: str | Path, first: int, end: int, rank: int) -> nn.Module:
    """Load layers ``[first, end)`` of the model, and on rank 0 the embedding, final norm and head too (gemma4's
    embedding on every stage where its layers take inputs of their own).

    The model is loaded lazily and the other layers dropped before anything is
    read, so a rank reads, and holds, only its stage (a tied head is the
    embedding, and both are rank 0's).
    """
    model, _ = load_model(Path(model_path), lazy=True)
    inner = backbone(model)
    inner.layers = inner.layers[first:end]
    _stage_layer_types(inner, first, end)
    # gemma4's per-layer inputs are computed on each stage from the embedding, which every stage then keeps.
    embeds_here = staged.slice_per_layer_inputs(inner, first, end)
    if rank != 0:
        for owner, name in ((inner, "embed_tokens"), (inner, "norm"), (model, "lm_head")):
            if name in owner and not (name == "embed_tokens" and embeds_here):
                del owner[name]
    for parameter in _arrays(model):
        mx.eval(parameter)
    fuse_projections(model)
    return model


def _stage_layer_types(inner: nn.Module, first: int, end: int) -> None:
    """Where the model's code makes each kind of mask from the cache of the first layer of that kind, point it at
    the stage's own first layers: by ``is_linear`` for linear attention (as mlx-lm's own ``pipeline()`` does), by
    ``layer_types`` for sliding windows, keeping the stage's part of that list (0 where the stage has no layer of
    the kind: that mask is then never used)."""
    layers = inner.layers
    if layers and hasattr(layers[0], "is_linear") and hasattr(inner, "ssm_idx"):  # linear attention, as its pipeline()
        inner.ssm_idx = next((e for e, layer in enumerate(layers) if layer.is_linear), None)
        inner.fa_idx = next((e for e, layer in enumerate(layers) if not layer.is_linear), None)
        return
    types = getattr(inner, "layer_types", None)
    if not isinstance(types, list):
        return
    inner.layer_types = types = types[first:end]
    for name, kind in (("fa_idx", "full_attention"), ("ga_idx", "full_attention"), ("swa_idx", "sliding_attention")):
        if hasattr(inner, name):
            setattr(inner, name, types.index(kind) if kind in types else 0)


def parameter_count(model: nn.Module) -> int:
    return sum(v.size for v in _arrays(model))


def _arrays(model: nn.Module) -> list[mx.array]:
    """The model's parameters (``tree_flatten`` without a destination gives a list of name and array pairs)."""
    return [v for _, v in cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))]
