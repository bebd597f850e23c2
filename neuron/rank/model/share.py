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

from neuron.models import architectures, shares
from neuron.models.folder import ModelError, text_config
from neuron.rank.dist import backends
from neuron.rank.model import splits, staged
from neuron.rank.model.fuse import fuse_projections
from neuron.rank.model.parts import backbone


def check_splittable(config: dict, world_size: int, stages: int = 1) -> None:
    """Raise ``ModelError`` unless a model of this config can be split over ``world_size`` ranks, in ``stages``
    pipeline stages (tensor parallel over all of them when 1): what ``neuron.models.architectures`` says of it, then
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
    split_head = arch in ("qwen3_5", "qwen3_5_moe") and not text.get("tie_word_embeddings", False)
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
    _check_quantized_split(config, text, arch, world_size)


def _check_quantized_split(config: dict, text: dict, arch: str, world_size: int) -> None:
    """A quantized layer whose inputs are split over the ranks (the attention's output projection, the MLP's down
    projection) must give each rank whole quantization groups: MLX cannot split a group, and neuron does not
    regroup one (that would change the model's weights). A layer too narrow to be quantized at all was left
    unquantized by its converter, and splits as it is."""
    group = (config.get("quantization") or {}).get("group_size")
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    if not isinstance(group, int) or not isinstance(heads, int) or not isinstance(hidden, int):
        return
    widths = {
        "attention output": heads * int(text.get("head_dim") or hidden // heads),
        "MLP's down projection": text.get("intermediate_size"),
    }
    for name, width in widths.items():
        if isinstance(width, int) and width % group == 0 and (width // world_size) % group:
            fits = [n for n in range(1, heads + 1) if heads % n == 0 and width % n == 0 and (width // n) % group == 0]
            raise ModelError(
                f"{arch!r} is quantized in groups of {group}, and its {name}'s {width} inputs split over "
                f"{world_size} ranks leave {width / world_size:g} to each, not whole groups; use --tp with one of "
                f"{fits}, or a conversion quantized in smaller groups"
            )


# Architectures whose logits are exactly the head (or the tied embedding) applied to the backbone's output:
# nothing after it (no soft-capping, no scaling) that a split head would skip.
PLAIN_HEAD = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# A split head costs one all_gather per step and saves reading half the head on rank 0's core: on the 2-core
# development box it pays from about 5M fp32 parameters (BENCHMARKS.md, "When a split LM head pays"); 8M leaves
# a margin.
SPLIT_HEAD_MIN_PARAMS = 8_000_000


@dataclass(frozen=True, slots=True)
class VocabSlice:
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


def slice_head(model: nn.Module, model_type: str, group: mx.distributed.Group | None) -> VocabSlice | None:
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
    return VocabSlice(mine, vocab, group)


def load_share(model_path: str | Path, group: mx.distributed.Group | None) -> nn.Module:
    """Load the model lazily, keep this rank's slices, then materialize only those.

    One tensor at a time: evaluating a slice reads its whole tensor from disk,
    and evaluating every slice at once would hold every whole tensor at the
    same moment, a peak as large as the unsplit model on every rank. A pushed
    share (``neuron.models.shares``) holds the slices themselves, read as they are.
    """
    model = _load_share(model_path, group, [], group.rank() if group is not None else 0)
    for parameter in _arrays(model):
        mx.eval(parameter)
    fuse_projections(model)  # after the split: each rank fuses its own slices (its heads' rows of q, k, v)
    backends.clear_cache()  # the unfused projections' buffers go back to the system, not to MLX's cache
    return model


def load_stage(model_path: str | Path, first: int, end: int, rank: int) -> nn.Module:
    """Load layers ``[first, end)`` of the model, and on rank 0 the embedding, final norm and head too (gemma4's
    embedding on every stage where its layers take inputs of their own).

    The model is loaded lazily and the other layers dropped before anything is
    read, so a rank reads, and holds, only its stage (a tied head is the
    embedding, and both are rank 0's).
    """
    model = _load_share(model_path, None, [first, end], rank)
    for parameter in _arrays(model):
        mx.eval(parameter)
    fuse_projections(model)
    backends.clear_cache()
    return model


def _load_share(model_path: str | Path, group: mx.distributed.Group | None, layers: list[int], rank: int) -> nn.Module:
    """The model cut down to this rank's share, lazily: from the whole model, or from a pushed share, whose
    tensors go in where the same cut of the whole model put its own."""
    path = Path(model_path)
    if not shares.is_share(path) and layers and _partial(path):
        return _load_stage_files(path, layers, rank)
    if not shares.is_share(path):
        model, config = load_model(path, lazy=True, get_model_classes=_without_prediction_layers)
        model.__class__ = model.__class__.__mro__[1]  # the model's own class again
        take_share(model, config, group, layers, rank)
        return model
    model, config, pushed = _skeleton(path)
    names = take_share(model, config, group, layers, rank)
    if missing := sorted(set(names.values()) - set(pushed)):
        raise ModelError(f"{path} is a share without {missing[0]} ({len(missing)} tensors missing): push it again")
    model.load_weights([(now, pushed[whole]) for now, whole in names.items()], strict=True)
    return model


def _partial(path: Path) -> bool:
    """Whether the folder lacks safetensors files its index lists: a stage's files alone, fetched from the Hub."""
    return (path / shares.INDEX).is_file() and any(
        not (path / name).is_file() for name in set(shares.tensor_files(path).values())
    )


def _load_stage_files(path: Path, layers: list[int], rank: int) -> nn.Module:
    """A stage from a folder holding only the files its tensors lie in (``shares.files_read``): loaded without
    mlx-lm's check that every parameter has its tensor, which the other stages' layers lack here, then checked
    that every parameter the stage keeps had one."""
    loaded: set[str] = set()

    def classes(config: dict) -> tuple[type[nn.Module], type]:
        model_class, args_class = _without_prediction_layers(config)

        class Model(model_class):  # type: ignore[valid-type, misc]
            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                weights = super().sanitize(weights)
                loaded.update(weights)
                return weights

        Model.__name__ = model_class.__name__
        return Model, args_class

    model, config = load_model(path, lazy=True, strict=False, get_model_classes=classes)
    model.__class__ = model.__class__.__mro__[2]  # the model's own class again
    names = take_share(model, config, None, layers, rank)
    if missing := sorted(set(names.values()) - loaded):
        raise ModelError(
            f"{path} lacks {missing[0]} ({len(missing)} tensors) that the stage of layers [{layers[0]}, {layers[1]}) "
            "loads: fetch the model whole there (neuron pull), or pass --push-model to have the leader send the stage"
        )
    return model


def _without_prediction_layers(config: dict) -> tuple[type[nn.Module], type]:
    """mlx-lm's classes, whose sanitize first drops the multi-token-prediction layers, numbered after the last:
    mlx-lm's deepseek_v3 drops DeepSeek V3's own (layer 61) alone, and a model of another depth would not load
    (rank.mtp loads them for --speculate mtp). Qwen3-Next's (``mtp.*``), which mlx-lm drops only from checkpoints
    whose experts it has yet to stack, likewise."""
    model_class, args_class = _get_classes(config)
    first = int(text_config(config).get("num_hidden_layers") or 0)
    extra = tuple(f"model.layers.{first + i}." for i in range(architectures.mtp_heads(config)))
    if extra and architectures.architecture(config) == "qwen3_next":
        extra = ("mtp.",)

    class Model(model_class):  # type: ignore[valid-type, misc]
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            weights = {k: v for k, v in weights.items() if not (extra and k.startswith(extra))}
            return super().sanitize(weights) if hasattr(model_class, "sanitize") else weights

    Model.__name__ = model_class.__name__
    return Model, args_class


def _skeleton(path: Path) -> tuple[nn.Module, dict, dict[str, mx.array]]:
    """mlx-lm's own ``load_model`` (its classes, its sanitizing, its quantization), with a share's tensors kept
    aside rather than put in: they are already sliced, and the cut expects whole ones. mlx-lm infers each layer's
    quantization from its tensors' shapes, so it is shown shapes as the whole model's (placeholders, never read)."""
    kept: dict[str, mx.array] = {}
    whole = shares.whole_shapes(path)

    def classes(config: dict) -> tuple[type[nn.Module], type]:
        model_class, args_class = _get_classes(config)
        own_sanitize = getattr(model_class, "sanitize", None)

        class Skeleton(model_class):  # type: ignore[valid-type, misc]
            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                kept.update(own_sanitize(self, weights) if own_sanitize else weights)
                return {name: mx.zeros(whole.get(name, list(w.shape)), w.dtype) for name, w in kept.items()}

            def load_weights(self, weights: list, strict: bool = True) -> nn.Module:
                return self

        Skeleton.__name__ = model_class.__name__
        return Skeleton, args_class

    model, config = load_model(path, lazy=True, get_model_classes=classes)
    model.__class__ = model.__class__.__mro__[1]  # the model's own class again, with its own methods
    return model, config, kept


class Slot:
    """A rank's place in a group, without the group: enough for mlx's sharding helpers to slice for that rank (they
    ask only ``rank()`` and ``size()``), so the leader can cut another rank's share as that rank cuts it."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def take_share(
    model: nn.Module, config: dict, group: mx.distributed.Group | Slot | None, layers: list[int], rank: int
) -> dict[str, str]:
    """Cut a lazily loaded model down to what ``rank`` holds: the stage's layers ``[first, end)`` (rank 0 keeps the
    embedding, final norm and head), or its slice of every layer (``group`` of more than one). Returns each kept
    parameter's path now -> its name in the whole model (a stage's layers are numbered from 0 once cut)."""
    before = {id(v): (name, v) for name, v in _named(model)}  # the arrays held, so that no id is reused
    if layers:
        first, end = layers
        inner = backbone(model)
        inner.layers = inner.layers[first:end]
        _stage_layer_types(inner, first, end)
        # gemma4's per-layer inputs are computed on each stage from the embedding, which every stage then keeps.
        embeds_here = staged.slice_per_layer_inputs(inner, first, end)
        if rank != 0:
            for owner, name in ((inner, "embed_tokens"), (inner, "norm"), (model, "lm_head")):
                if name in owner and not (name == "embed_tokens" and embeds_here):
                    del owner[name]
    elif group is not None and group.size() > 1:
        splits.split(model, config.get("model_type", ""), cast("mx.distributed.Group", group))
    return {path: before.get(id(v), (path, v))[0] for path, v in _named(model)}


def _named(model: nn.Module) -> list[tuple[str, mx.array]]:
    return cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))


# safetensors' names of MLX's dtypes.
SAFETENSORS_DTYPES = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.uint16: "U16",
    mx.int16: "I16",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.int64: "I64",
    mx.uint64: "U64",
    mx.bool_: "BOOL",
}


class ShareSource:
    """Another rank's share, cut on the leader from its own model by ``take_share``, as that rank would cut it:
    the tensors it will load, named as in the whole model, each computed when asked (``launch.push.Source``)."""

    def __init__(self, model_path: str | Path, rank: int, size: int, layers: list[int]) -> None:
        model, config = load_model(Path(model_path), lazy=True)
        self.whole = {name: list(v.shape) for name, v in _named(model)}
        names = take_share(model, config, Slot(rank, size) if size > 1 and not layers else None, layers, rank)
        flat = dict(_named(model))
        self.tensors: dict[str, mx.array] = {whole: flat[now] for now, whole in names.items()}

    def entries(self) -> list[shares.Entry]:
        return [
            shares.Entry(name, SAFETENSORS_DTYPES[a.dtype], list(a.shape), a.nbytes, self.whole[name])
            for name, a in sorted(self.tensors.items())
        ]

    def data(self, name: str) -> memoryview:
        """The tensor's bytes, row-major; the leader's copy is let go once sent."""
        array = mx.contiguous(self.tensors.pop(name))
        mx.eval(array)
        return memoryview(array)  # type: ignore[arg-type]  # mx.array exports the buffer protocol


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
    return [v for _, v in _named(model)]
