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

No weight is held twice: each projection's ``weight`` (and ``bias``) is a view
of its rows of the fused array, so the parameter tree keeps its names, shapes
and count, and the fused arrays themselves are kept under ``_``-prefixed names,
which MLX leaves out of ``parameters()``.

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
from mlx.nn.layers.distributed import AllToShardedLinear

# Projections mlx-lm's models call in this order on one input; the first computes all of them.
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
GROUPS = (QKV, GATE_UP)

# Linear layers whose forward is exactly ``x @ weight.T (+ bias)``: a sharded one's forward adds only an
# identity for the gradients (``sum_gradients``), which inference never needs.
PLAIN_LINEAR = (nn.Linear, AllToShardedLinear)


@dataclass(slots=True)
class _Pending:
    """The parts of the last fused product not yet handed out, and the input they belong to."""

    x: mx.array | None = None
    parts: dict[int, mx.array] = field(default_factory=dict)


class FusedLead(nn.Module):
    """The first projection of a group: computes every member's product at once and keeps the others' parts."""

    sharded = False  # fused from projections whose outputs are split over the group (a LoRA slices B so)

    def __init__(self, weight: mx.array, bias: mx.array | None, rows: list[int], pending: _Pending) -> None:
        super().__init__()
        self._fused_weight = weight
        self._fused_bias = bias
        self._cuts = [sum(rows[: i + 1]) for i in range(len(rows) - 1)]  # where each member's columns start
        self._pending = pending
        self.weight = weight[: rows[0]]
        if bias is not None:
            self.bias = bias[: rows[0]]

    def __call__(self, x: mx.array) -> mx.array:
        if self._fused_bias is not None:
            y = mx.addmm(self._fused_bias, x, self._fused_weight.T)  # as nn.Linear does: one call, bias included
        else:
            y = x @ self._fused_weight.T
        parts = mx.split(y, self._cuts, axis=-1)
        self._pending.x = x
        self._pending.parts = dict(enumerate(parts[1:], start=1))
        return parts[0]


class FusedFollower(nn.Module):
    """A later projection of a group: its part of the lead's product when called on the lead's input."""

    sharded = False

    def __init__(self, weight: mx.array, bias: mx.array | None, index: int, pending: _Pending) -> None:
        super().__init__()
        self._index = index
        self._pending = pending
        self.weight = weight
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        pending = self._pending
        if pending.x is x and self._index in pending.parts:
            part = pending.parts.pop(self._index)
            if not pending.parts:
                pending.x = None  # every part handed out: hold no array past the layer
            return part
        if "bias" in self:  # not the lead's input: this projection's own product, from its view of the weights
            return mx.addmm(self["bias"], x, self["weight"].T)
        return x @ self["weight"].T


def _fusable(linears: list[nn.Module]) -> bool:
    first = linears[0]
    return (
        all(type(m) in PLAIN_LINEAR for m in linears)
        and all(mx.issubdtype(m.weight.dtype, mx.floating) for m in linears)
        and len({(m.weight.dtype, m.weight.shape[1]) for m in linears}) == 1
        and len({"bias" in m for m in linears}) == 1
        and ("bias" not in first or len({m.bias.dtype for m in linears}) == 1)
    )


def fuse_group(owner: nn.Module, names: tuple[str, ...]) -> bool:
    """Replace ``owner``'s projections ``names`` by a fused lead and its followers; False where they don't fit
    (missing, quantized, of different input widths or dtypes, biased unevenly), left as they were."""
    if not all(name in owner for name in names):
        return False
    linears = [owner[name] for name in names]
    if not _fusable(linears):
        return False
    weight = mx.concatenate([m.weight for m in linears])
    bias = mx.concatenate([m.bias for m in linears]) if "bias" in linears[0] else None
    mx.eval(weight, bias)
    rows = [m.weight.shape[0] for m in linears]
    pending = _Pending()
    lead = FusedLead(weight, bias, rows, pending)
    members: list[nn.Module] = [lead]
    start = rows[0]
    for index, count in enumerate(rows[1:], start=1):
        part_bias = None if bias is None else bias[start : start + count]
        members.append(FusedFollower(weight[start : start + count], part_bias, index, pending))
        start += count
    # Row slices of an evaluated array share its buffer: evaluating them makes views, not copies, and drops the
    # separate arrays the model held (their memory is freed as the old modules go).
    mx.eval([m.parameters() for m in members])
    for name, member in zip(names, members, strict=True):
        member.sharded = type(linears[0]) is AllToShardedLinear
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
