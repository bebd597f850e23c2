"""Fused projections: q, k and v as one matrix product, and the MLP's gate and up as another.

Why: a CPU decode step multiplies one row (or a few) by every weight matrix, and
each product is a BLAS call with its own dispatch, thread wake-up and MLX graph
node. Three products (576, 192 and 192 columns for SmolLM2) cost more than one
of 960, though they read the same bytes. mlx-lm's model code stays as it is: ``q_proj``
becomes a module that computes the fused product ``x @ W_qkv.T`` and splits it,
and keeps the k and v parts for that same ``x`` (the same array object), which
the ``k_proj`` and ``v_proj`` replacements hand back. Called with another input
(a model that calls them otherwise), a follower computes its own product from
its rows of the fused weight, so the answer is right either way; only the saving
is lost.

Quantized projections fuse alike where they share a layout (bits, group size,
mode and the scales' dtype): their packed words, scales and biases are
concatenated by rows, and the fused product is a ``QuantizedLinear``'s, which
on a Linux CPU goes through neuron's kernel (``rank.model.kernels``).

No weight is held twice: each projection's ``weight`` (and ``bias``, scales and
biases) is a view of its rows of the fused arrays, so the parameter tree keeps
its names, shapes and count, and the layers that compute (the group's product,
and each follower's own) hold the same arrays under ``_``-prefixed names, which
MLX leaves out of ``parameters()``.

Both groups pay, each on its own, at one row and at eight, with one-row
products sent to sgemm or to sgemv (BENCHMARKS.md, "Fused projections"). At one
row the saving is fewer calls, each with a fixed cost (sgemm's set-up and
packing, waking the BLAS's second thread): a step makes 211 weight products
unfused, 121 fused. At eight rows the products read the same bytes and the gain
is smaller.

Results: the fused product's columns are bitwise the separate products' with
the mlx wheel's reference BLAS, and with OpenBLAS at the few rows of a decode
step (to 28 rows at two threads); from there (prefill, or 8 rows at one
thread) OpenBLAS takes another kernel for the wider product and the last bits
of the sums differ (logits by about 2e-6 of their scale), as they do between
TP=1 and TP=2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear

# Projections mlx-lm's models call in this order on one input; the first computes all of them.
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
GROUPS = (QKV, GATE_UP)

# Linear layers whose forward is exactly ``x @ weight.T (+ bias)``: a sharded one's forward adds only an
# identity for the gradients (``sum_gradients``), which inference never needs.
PLAIN_LINEAR = (nn.Linear, AllToShardedLinear)
# The same, against quantized weights: ``quantized_matmul(x, weight, scales, biases) (+ bias)``.
QUANTIZED_LINEAR = (nn.QuantizedLinear, QuantizedAllToShardedLinear)
# What a quantized layer's arrays and settings are, beside ``weight`` and ``bias``.
QUANTIZED_ARRAYS = ("scales", "biases")
QUANTIZED_SETTINGS = ("group_size", "bits", "mode")


@dataclass(slots=True)
class _Pending:
    """The parts of the last fused product not yet handed out, and the input they belong to."""

    x: mx.array | None = None
    parts: dict[int, mx.array] = field(default_factory=dict)


def _layer(like: nn.Module, arrays: dict[str, mx.array]) -> nn.Module:
    """A layer of ``like``'s kind (plain, or quantized with its settings) over ``arrays``, computing the product
    that kind computes; made small, then given the arrays, so that no weights of its own are ever drawn."""
    layer: nn.Module
    if type(like) in QUANTIZED_LINEAR:
        layer = nn.QuantizedLinear(like.group_size, 1, "bias" in arrays, like.group_size, like.bits, like.mode)
    else:
        layer = nn.Linear(1, 1, "bias" in arrays)
    layer.update(arrays)
    return layer


def _present(member: nn.Module, like: nn.Module, views: dict[str, mx.array]) -> None:
    """Show a fused projection as the layer it replaces: its rows of each fused array, under that layer's names and
    settings, so that the parameter tree, a LoRA's wrapping and a quantized layer's checks see that layer. The
    layers that compute hold the same arrays under ``_``-prefixed names, which ``parameters()`` skips."""
    for name in QUANTIZED_SETTINGS:
        if hasattr(like, name):
            setattr(member, name, getattr(like, name))
    for name, view in views.items():
        member[name] = view


class FusedLead(nn.Module):
    """The first projection of a group: computes every member's product at once and keeps the others' parts."""

    sharded = False  # fused from projections whose outputs are split over the group (a LoRA slices B so)

    def __init__(self, like: nn.Module, fused: dict[str, mx.array], rows: list[int], pending: _Pending) -> None:
        super().__init__()
        _present(self, like, {name: array[: rows[0]] for name, array in fused.items()})
        self._fused = _layer(like, fused)
        self._cuts = [sum(rows[: i + 1]) for i in range(len(rows) - 1)]  # where each member's columns start
        self._pending = pending

    def __call__(self, x: mx.array) -> mx.array:
        parts = mx.split(self._fused(x), self._cuts, axis=-1)
        self._pending.x = x
        self._pending.parts = dict(enumerate(parts[1:], start=1))
        return parts[0]


class FusedFollower(nn.Module):
    """A later projection of a group: its part of the lead's product when called on the lead's input."""

    sharded = False

    def __init__(self, like: nn.Module, views: dict[str, mx.array], index: int, pending: _Pending) -> None:
        super().__init__()
        _present(self, like, views)
        self._own = _layer(like, views)  # its product alone, from its rows of the fused arrays
        self._index = index
        self._pending = pending

    def __call__(self, x: mx.array) -> mx.array:
        pending = self._pending
        if pending.x is x and self._index in pending.parts:
            part = pending.parts.pop(self._index)
            if not pending.parts:
                pending.x = None  # every part handed out: hold no array past the layer
            return part
        return self._own(x)  # not the lead's input: this projection's own product


def _arrays(layer: nn.Module) -> dict[str, mx.array]:
    return {name: layer[name] for name in ("weight", "bias", *QUANTIZED_ARRAYS) if name in layer}


def _fusable(linears: list[nn.Module]) -> bool:
    kinds = {type(m) for m in linears}
    if kinds <= set(PLAIN_LINEAR):
        same = {(m.weight.dtype, m.weight.shape[1]) for m in linears}
        floating = all(mx.issubdtype(m.weight.dtype, mx.floating) for m in linears)
    elif kinds <= set(QUANTIZED_LINEAR):
        same = {(m.weight.shape[1], m.scales.dtype, *(getattr(m, s) for s in QUANTIZED_SETTINGS)) for m in linears}
        floating = True
    else:
        return False
    arrays = {tuple(_arrays(m)) for m in linears}  # the same arrays in each (a bias in all or none)
    biases = {m.bias.dtype for m in linears if "bias" in m}
    return floating and len(same) == 1 and len(arrays) == 1 and len(biases) <= 1


def fuse_group(owner: nn.Module, names: tuple[str, ...]) -> bool:
    """Replace ``owner``'s projections ``names`` by a fused lead and its followers; False where they don't fit
    (missing, of different kinds, input widths, dtypes or quantized layouts, biased unevenly), left as they were."""
    if not all(name in owner for name in names):
        return False
    linears = [owner[name] for name in names]
    if not _fusable(linears):
        return False
    like = linears[0]
    fused = {name: mx.concatenate([m[name] for m in linears]) for name in _arrays(like)}
    mx.eval(fused)
    rows = [m.weight.shape[0] for m in linears]
    pending = _Pending()
    members: list[nn.Module] = [FusedLead(like, fused, rows, pending)]
    start = rows[0]
    for index, count in enumerate(rows[1:], start=1):
        views = {name: array[start : start + count] for name, array in fused.items()}
        members.append(FusedFollower(like, views, index, pending))
        start += count
    # Row slices of an evaluated array share its buffer: evaluating them makes views, not copies, and drops the
    # separate arrays the model held (their memory is freed as the old modules go).
    mx.eval([m.parameters() for m in members], [m._own.parameters() for m in members[1:]])
    for name, member in zip(names, members, strict=True):
        member.sharded = type(like) in (AllToShardedLinear, QuantizedAllToShardedLinear)
        owner[name] = member
    return True


def fuse_projections(model: nn.Module, groups: tuple[tuple[str, ...], ...] = GROUPS) -> int:
    """Fuse every module's ``groups`` of projections in place; returns how many groups were fused."""
    # Only the modules that own a group are kept while fusing: a list of every module would hold each replaced
    # projection, and with it its separate weights, until the last group is fused, as large a peak as the model's
    # fused part again.
    owners = [module for _, module in model.named_modules() if any(names[0] in module for names in groups)]
    fused = 0
    for module in owners:
        for names in groups:
            fused += fuse_group(module, names)
    return fused
