"""LoRA adapters on one rank: each adapter's A and B matrices beside the projections they adapt, applied row by row.

Every projection an adapter targets is wrapped once (``Lora``), the first time an adapter needs it; the wrapper
holds each adapter's A (inputs x rank) and B (rank x outputs) and computes, as mlx-lm's ``LoRALinear`` does,
``y + (scale * ((x @ A) @ B)).astype(x.dtype)``. A step's rows may each use another adapter, or none: before each
forward the rank names every row's adapter (``Selection.use``), and each wrapper adds each adapter's product to
its rows alone, one product per adapter present (a base row gets nothing added, so its output is the base's,
bit for bit). Nothing is selected in a step of base rows only: the wrappers then cost one check each.

Under tensor parallelism each rank holds its slice of every adapter, cut along the dimension its projection is
split on: a projection whose outputs are split (q, k, v, gate, up: all-to-sharded) keeps its columns of B, one
whose inputs are split (o, down: sharded-to-all) its rows of A, and adds its partial product before the
projection's all-reduce, so that the sum over ranks is the whole product with no collective added. Under
pipeline parallelism a stage holds only its own layers' matrices.

An adapter is checked against the base as it loads, projection by projection: a layer or projection the base
lacks, or matrices whose shapes are not the projection's, mean it was trained for another base model; A's and B's
ranks must agree with each other and with the config's. Nothing is changed until every matrix has passed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)

from neuron.models.adapters import AdapterError, AdapterSpec
from neuron.rank.failures import RankError
from neuron.rank.model import kernels
from neuron.rank.model.fuse import FusedFollower, FusedLead
from neuron.rank.model.parts import backbone

_MLX_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_(a|b)$")
_PEFT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_(A|B)\.weight$")
# Projections fused over several heads' kinds by the checkpoint itself, which a rank splits piece by piece
# (``plans._phi3``): their rows of B are not one contiguous slice.
_SEGMENTED = frozenset({"qkv_proj", "gate_up_proj", "in_proj_qkvz", "in_proj_ba"})

Pair = tuple[mx.array, mx.array]  # A (inputs x rank), B (rank x outputs)


class Selection:
    """The adapters of the forward being built, each with the rows it applies to; shared by every wrapper."""

    def __init__(self) -> None:
        # (adapter, a boolean mask over the rows; None where every row is the adapter's: no mask to apply)
        self.active: list[tuple[int, mx.array | None]] = []

    def use(self, adapters: Sequence[int] | None) -> None:
        """Each row's adapter (0: the base) for the forwards built from now; None or all 0: no adapter."""
        if not adapters or not any(adapters):
            self.active = []
            return
        if len(set(adapters)) == 1:
            self.active = [(adapters[0], None)]
            return
        rows = mx.array(list(adapters))
        self.active = [(a, rows == a) for a in sorted(set(adapters) - {0})]


class Lora(nn.Module):
    """A projection with the adapters that target it."""

    def __init__(self, base: nn.Module, selection: Selection, inputs_split: bool) -> None:
        super().__init__()
        self.base = base
        self._selection = selection
        self._inputs_split = inputs_split  # its partial products join in the base's all-reduce
        self._pairs: dict[int, tuple[mx.array, mx.array, float]] = {}

    def _deltas(self, x: mx.array) -> mx.array | None:
        total = None
        for adapter, mask in self._selection.active:
            if (pair := self._pairs.get(adapter)) is None:
                continue
            a, b, scale = pair
            delta = (scale * ((x @ a) @ b)).astype(x.dtype)
            if mask is not None:
                delta = mx.where(mask.reshape(-1, *([1] * (x.ndim - 1))), delta, 0)
            total = delta if total is None else total + delta
        return total

    def __call__(self, x: mx.array) -> mx.array:
        deltas = self._deltas(x) if self._selection.active else None
        if deltas is None:
            return self.base(x)
        base = self.base
        if not self._inputs_split:
            return base(x) + deltas
        # The base's own call, with the partial products added before its one all-reduce: a rank's collectives
        # stay the same whatever its rows' adapters.
        if getattr(base, "kernel", None) is not None:  # its weights may be packed for the kernel (``pack_layers``)
            partial = kernels.product(base, x)
        elif isinstance(base, QuantizedShardedToAllLinear):
            partial = mx.quantized_matmul(
                x,
                base["weight"],
                scales=base["scales"],
                biases=base.get("biases"),
                transpose=True,
                group_size=base.group_size,
                bits=base.bits,
                mode=base.mode,
            )
        else:
            partial = x @ base["weight"].T
        y = mx.distributed.all_sum(partial + deltas, group=base.group)
        return y + base["bias"] if "bias" in base else y


class Adapters:
    """The adapters loaded on one rank, by the leader's number for each."""

    def __init__(
        self, model: nn.Module, group: mx.distributed.Group | None, first: int, total: int, selection: Selection
    ) -> None:
        self.model = model
        self.layers = backbone(model).layers
        self.group = group  # tensor parallel: each projection split over it; None for a stage or a single rank
        self.first = first  # the number of this rank's first layer in the whole model (a stage's)
        self.total = total  # layers in the whole model
        self.selection = selection  # the runner's: it names each forward's rows' adapters
        self.loaded: dict[int, str] = {}  # number -> name
        self._wrapped: list[Lora] = []

    def load(self, number: int, spec: AdapterSpec) -> int:
        """Load ``spec`` as adapter ``number``: this rank's slice of each matrix that targets one of its layers.
        Returns how many projections here it adapts; ``RankError`` naming the first problem, with nothing
        changed."""
        if number in self.loaded:
            raise RankError(f"adapter {number} ({self.loaded[number]}) is loaded already; unload it first")
        try:
            tensors = mx.load(str(spec.weights))
        except (OSError, RuntimeError, ValueError) as e:
            raise RankError(f"adapter {spec.name!r}: cannot read {spec.weights}: {e}") from None
        assert isinstance(tensors, dict)
        pairs = _pairs(spec, tensors)
        placed: list[tuple[nn.Module, str, nn.Module, mx.array, mx.array]] = []
        for (layer, path), (a, b) in sorted(pairs.items()):
            if not 0 <= layer < self.total:
                raise _other_base(spec, f"it adapts layer {layer}, and the base has {self.total} layers")
            if not self.first <= layer < self.first + len(self.layers):
                continue  # another stage's
            owner, name, projection = self._find(spec, layer, path)
            a, b = self._slice(spec, f"layers.{layer}.{path}", projection, a, b)
            placed.append((owner, name, projection, a, b))
        mx.eval([(a, b) for *_, a, b in placed])
        for owner, name, projection, a, b in placed:
            wrapper = projection if isinstance(projection, Lora) else self._wrap(owner, name, projection)
            wrapper._pairs[number] = (a, b, spec.scale)
        self.loaded[number] = spec.name
        return len(placed)

    def unload(self, number: int) -> None:
        self.loaded.pop(number, None)
        for wrapper in self._wrapped:
            wrapper._pairs.pop(number, None)

    def _find(self, spec: AdapterSpec, layer: int, path: str) -> tuple[nn.Module, str, nn.Module]:
        """The module at ``path`` in ``layer``: its owner, its name there, and itself."""
        owner: nn.Module = self.layers[layer - self.first]
        *parents, name = path.split(".")
        for part in parents:
            child = owner.get(part) if isinstance(owner, nn.Module) else None
            if not isinstance(child, nn.Module):
                raise _other_base(spec, f"the base's layers have no {path}")
            owner = child
        projection = owner.get(name)
        if not isinstance(projection, nn.Module) or "weight" not in (getattr(projection, "base", projection)):
            raise _other_base(spec, f"the base's layers have no projection {path}")
        return owner, name, projection

    def _slice(self, spec: AdapterSpec, where: str, projection: nn.Module, a: mx.array, b: mx.array) -> Pair:
        """This rank's slice of ``a`` and ``b``, checked against the projection's whole shape."""
        base = projection.base if isinstance(projection, Lora) else projection
        out_here, in_here = _dims(base)
        size = self.group.size() if self.group is not None else 1
        split = _split(base) if size > 1 else ""
        if split and where.rsplit(".", 1)[-1] in _SEGMENTED:
            raise RankError(
                f"adapter {spec.name!r} adapts {where}, a fused projection split piece by piece under tensor "
                "parallelism; serve it with --tp 1"
            )
        whole_in = in_here * size if split == "inputs" else in_here
        whole_out = out_here * size if split == "outputs" else out_here
        if a.shape[0] != whole_in or b.shape[1] != whole_out:
            raise _other_base(
                spec,
                f"its {where} maps {a.shape[0]} inputs to {b.shape[1]} outputs, and the base's maps "
                f"{whole_in} to {whole_out}",
            )
        assert self.group is not None or not split
        if split == "outputs":
            rank = self.group.rank()  # type: ignore[union-attr]
            b = mx.contiguous(b[:, rank * out_here : (rank + 1) * out_here])
        elif split == "inputs":
            rank = self.group.rank()  # type: ignore[union-attr]
            a = mx.contiguous(a[rank * in_here : (rank + 1) * in_here])
        return a, b

    def _wrap(self, owner: nn.Module, name: str, projection: nn.Module) -> Lora:
        wrapper = Lora(projection, self.selection, _split(projection) == "inputs")
        owner[name] = wrapper
        self._wrapped.append(wrapper)
        return wrapper


def _pairs(spec: AdapterSpec, tensors: dict[str, mx.array]) -> dict[tuple[int, str], Pair]:
    """Each adapted projection's (layer, path in the layer) -> A (inputs x rank), B (rank x outputs), in mlx-lm's
    layout whatever the file's."""
    pattern = _MLX_KEY if spec.format == "mlx" else _PEFT_KEY
    found: dict[tuple[int, str], dict[str, mx.array]] = {}
    for key, tensor in tensors.items():
        match = pattern.search(key)
        if match is None:
            raise RankError(
                f"adapter {spec.name!r} holds {key}, outside the layers' linear projections; only those can be served"
            )
        if tensor.ndim != 2:
            raise RankError(f"adapter {spec.name!r}: {key} has shape {tensor.shape}, not a matrix")
        part = match[3].lower()
        found.setdefault((int(match[1]), match[2]), {})[part] = tensor if spec.format == "mlx" else tensor.T
    if not found:
        raise RankError(f"adapter {spec.name!r}: {spec.weights.name} holds no LoRA matrices")
    pairs: dict[tuple[int, str], Pair] = {}
    for (layer, path), parts in found.items():
        where = f"layers.{layer}.{path}"
        if set(parts) != {"a", "b"}:
            raise RankError(f"adapter {spec.name!r}: {where} has lora_{next(iter(parts))} without its pair")
        a, b = parts["a"], parts["b"]
        if a.shape[1] != b.shape[0] or a.shape[1] != spec.rank:
            raise RankError(
                f"adapter {spec.name!r}: {where}'s A is {tuple(a.shape)} and its B {tuple(b.shape)}, which do not "
                f"share the rank {spec.rank} its {Path('adapter_config.json')} gives; the adapter is damaged"
            )
        pairs[(layer, path)] = (a, b)
    return pairs


def _split(projection: nn.Module) -> str:
    """Which of the projection's dimensions this rank holds a slice of: "outputs", "inputs", or "" (whole)."""
    if isinstance(projection, ShardedToAllLinear | QuantizedShardedToAllLinear):
        return "inputs"
    if isinstance(projection, AllToShardedLinear | QuantizedAllToShardedLinear):
        return "outputs"
    if isinstance(projection, FusedLead | FusedFollower) and projection.sharded:
        return "outputs"
    return ""


def _dims(projection: nn.Module) -> tuple[int, int]:
    """The projection's (outputs, inputs) here; a quantized one packs its inputs into 32-bit words."""
    out, packed = projection["weight"].shape
    bits = getattr(projection, "bits", None)
    return out, packed * 32 // bits if "scales" in projection and bits else packed


def _other_base(spec: AdapterSpec, why: str) -> RankError:
    return RankError(
        f"adapter {spec.name!r} does not fit this base model: {why}; it was trained for another base model"
    )


__all__ = ["AdapterError", "Adapters", "Lora", "Selection"]
