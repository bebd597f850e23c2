"""neuron's CPU kernels in a loaded quantized model on a Linux CPU (``neuron/system/native/``: an MLX extension
built on first use): its products against quantized weights in place of MLX's CPU ``quantized_matmul``, and its
RMS norms, rotary embeddings, gated activations and attention (a prompt's: its softmax) as one node each.

Why: a decode step reads every weight once, and MLX's CPU ``quantized_matmul`` reads 4-bit weights slower than fp32
BLAS reads fp32 ones (BENCHMARKS.md, "Quantized weights on the CPU"). The kernel streams each packed word once,
on every core of the rank. Once the products are that fast, the rest of a small model's step is mostly MLX's
dispatch of its graph's nodes, and on the CPU ``mx.fast.rms_norm`` and ``mx.fast.rope`` expand into a dozen and
about thirty nodes each (``layers.cpp``). And the CPU wheel's MLX computes every exp one element at a time (its
SIMD types are one lane wide off ARM): mlx-lm's compiled ``swiglu``, and the softmax of attention, which over a
long context or a prompt is most of attention's time. A decode step's attention, a dozen nodes and a BLAS call per
head for a row each, is one (``attention.cpp``).

``use_kernel`` gives each quantized layer of a loaded model (MLX's ``QuantizedLinear``, its two tensor-parallel
variants, a fused group's product, and a quantized embedding's ``as_linear`` for a tied head) the kernel's product,
and each ``RMSNorm`` and ``RoPE`` the kernel's, by making it an instance of a subclass that overrides the call: its
parameters, their names and its type's checks stay as they are, and LoRA wraps it as before. Layouts the kernel
does not take (bits other than 4 and 8, groups that are not whole multiples of 32, modes other than affine) keep
MLX's product, and rows other than float32 MLX's norm and rotation.

mlx-lm's models call ``swiglu`` and ``scaled_dot_product_attention`` as names of their own module (``from
.activations import swiglu``), not as layers, so ``use_kernel`` sets those names, in the modules of the model's
layers, to the kernel's (``FUNCTIONS``). They compute the same bits as mlx-lm's (``layers.cpp`` follows MLX's
arithmetic operation for operation, and the attention is MLX's CPU fallback op for op with the softmax swapped and
a causal mask put inside it), so a
model of the same architecture loaded in the process without the kernel answers exactly as before; what they do not
take (other dtypes, a quantized cache, attention sinks) goes to mlx-lm's own.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import structlog
from mlx.nn.layers.distributed import QuantizedAllToShardedLinear, QuantizedShardedToAllLinear
from mlx.utils import tree_flatten
from mlx_lm.models import activations, base

from neuron.rank.model.fuse import FusedFollower, FusedLead
from neuron.system.native import build_quantized

log = structlog.get_logger("neuron.rank")

BITS = (4, 8)
# A block of rows the kernel packs together (``PACKED_COLUMNS`` in quantized.h).
PACKED_ROWS = 16


def load_kernel(cores: list[int], arch: str | None = None) -> tuple[ModuleType | None, str]:
    """The kernel's module (built for ``arch``, this machine's instruction set unless given), set to compute on
    ``cores``; else None and why (no compiler, no CMake, another nanobind than MLX's), which the rank says once
    with how to get it. For a Linux CPU rank (``rank.model.load``)."""
    built = build_quantized(arch)
    if built.path is None:
        return None, built.problem
    # OpenMP's helpers spin only briefly once a product is done (its runtime reads this as it loads, with the
    # module): the BLAS's own threads (a prompt's products, attention) need the same cores next, and a helper that
    # spins for its default hundreds of microseconds holds them off, where a wake-up costs a few (BENCHMARKS.md).
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    try:
        loader = importlib.machinery.ExtensionFileLoader("_quantized", str(built.path))
        spec = importlib.util.spec_from_loader("_quantized", loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        # A module built against a nanobind whose ABI is not MLX's cannot take MLX's arrays: find out now.
        w, scales, biases = mx.quantize(mx.ones((1, 32)), group_size=32, bits=4)
        mx.eval(module.quantized_rows(mx.ones((1, 32)), w, scales, biases, 32, 4))
    except (ImportError, TypeError, RuntimeError, AssertionError) as e:
        return None, f"the quantized kernel built at {built.path} does not load: {e}"
    module.set_cores(cores)
    return module, ""


def fits(layer: nn.Module) -> bool:
    """Whether the kernel takes this layer's layout."""
    return (
        getattr(layer, "mode", "affine") == "affine"
        and getattr(layer, "bits", None) in BITS
        and getattr(layer, "group_size", 0) % 32 == 0
        and "biases" in layer
    )


def product(layer: Any, x: mx.array) -> mx.array:
    """``x @ dequantize(layer's weight).T`` through the kernel (its weights packed, where ``pack_layers`` did)."""
    packed = getattr(layer, "packed", False)
    out: mx.array = layer.kernel.quantized_rows(x, layer["weight"], layer["scales"], layer["biases"],
                                                layer.group_size, layer.bits, packed)  # fmt: skip
    return out


class KernelLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = product(self, x)
        return y + self["bias"] if "bias" in self else y


class KernelAllToSharded(QuantizedAllToShardedLinear):
    def __call__(self, x: mx.array) -> mx.array:  # inference needs no gradient's sum (``sum_gradients``)
        y = product(self, x)
        return y + self["bias"] if "bias" in self else y


class KernelShardedToAll(QuantizedShardedToAllLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(product(self, x), group=self.group)
        return y + self["bias"] if "bias" in self else y


class KernelEmbedding(nn.QuantizedEmbedding):
    def __call__(self, x: mx.array) -> mx.array:
        # The rows in the activations' dtype, dequantized in float32 as the kernel does: MLX's own lookup gives the
        # scales' dtype, and float16 scales (a GGUF file's) would round a float32 model's every input to float16.
        packed = getattr(self, "packed", False)
        weight, scales, biases = (_rows(self[leaf], x, packed) for leaf in ARRAYS)
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        rows = mx.dequantize(weight, scales, biases, group_size=self.group_size, bits=self.bits)
        return rows.astype(self.activations)

    def as_linear(self, x: mx.array) -> mx.array:
        return product(self, x)


def _rows(array: mx.array, ids: mx.array, packed: bool) -> mx.array:
    """Rows ``ids`` of one of a quantized layer's arrays, in MLX's layout or packed (``pack_layers``: each block of
    ``PACKED_ROWS`` rows transposed, so row r is lane r % 16 of its block's columns)."""
    if not packed:
        return array[ids]
    blocks = array.reshape(array.shape[0] // PACKED_ROWS, array.shape[1], PACKED_ROWS)
    return blocks[ids // PACKED_ROWS, :, ids % PACKED_ROWS]


class KernelRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype == mx.float32 and self["weight"].dtype == mx.float32:
            out: mx.array = self.kernel.rms_norm_rows(x, self["weight"], self.eps)
            return out
        return super().__call__(x)


class KernelRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.dtype != mx.float32:
            return super().__call__(x, offset)  # type: ignore[arg-type]  # mlx-lm passes a batch's offsets too
        offsets = mx.array(offset, dtype=mx.int32) if isinstance(offset, int) else offset.astype(mx.int32)
        out: mx.array = self.kernel.rotary_rows(x, offsets, self.dims, self.traditional, self.base, self.scale)
        return out


# Each of MLX's quantized layers, and its kernel's subclass. Exact types: a subclass of one (another library's)
# may compute otherwise, and keeps its own call.
PRODUCT_CLASSES: dict[type, type] = {
    nn.QuantizedLinear: KernelLinear,
    QuantizedAllToShardedLinear: KernelAllToSharded,
    QuantizedShardedToAllLinear: KernelShardedToAll,
    nn.QuantizedEmbedding: KernelEmbedding,
}
# MLX's norm and rotation layers, one node each through the kernel (float32 rows; others keep MLX's call).
LAYER_CLASSES: dict[type, type] = {nn.RMSNorm: KernelRMSNorm, nn.RoPE: KernelRoPE}
# The layers whose weights the kernel may pack (``pack_layers``), and the arrays it packs.
PACKED_CLASSES = (KernelLinear, KernelAllToSharded, KernelShardedToAll, KernelEmbedding)
ARRAYS = ("weight", "scales", "biases")


# How ``Taken`` counts what each subclass computes; every other is a product.
KINDS: dict[type, str] = {KernelRMSNorm: "norms", KernelRoPE: "rotations"}


def kernel_swiglu(kernel: ModuleType) -> Callable[[mx.array, mx.array], mx.array]:
    """mlx-lm's ``swiglu(gate, x)`` through the kernel, where both are float32 arrays of one shape."""

    def swiglu_rows(gate: mx.array, x: mx.array) -> mx.array:
        if gate.dtype == x.dtype == mx.float32 and gate.shape == x.shape:
            out: mx.array = kernel.swiglu_rows(gate, x)
            return out
        return activations.swiglu(gate, x)

    return swiglu_rows


# Query rows a head up to which attention is the kernel's one node (``attention_rows``): a decode step's one, or a
# speculative step's few. A prompt's many are products a BLAS does best.
DECODE_QUERIES = 8


def kernel_attention(kernel: ModuleType) -> Callable[..., mx.array]:
    """mlx-lm's ``scaled_dot_product_attention`` through the kernel, where it would call MLX's
    ``mx.fast.scaled_dot_product_attention`` on float32 arrays without sinks. For up to ``DECODE_QUERIES`` query
    rows, one node (``attention_rows``), whose sums are taken in an order of its own; for more, MLX's CPU fallback
    (``mlx/fast.cpp``) op for op, with the kernel's softmax, which puts a causal mask in itself: MLX's bits.
    Anything else (a quantized cache, sinks, other dtypes) goes to mlx-lm's own."""

    def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                  sinks: mx.array | None = None) -> mx.array:  # fmt: skip
        if (
            hasattr(cache, "bits")
            or sinks is not None
            or not queries.dtype == keys.dtype == values.dtype == mx.float32
            or (isinstance(mask, str) and mask != "causal")
        ):
            return base.scaled_dot_product_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        causal = isinstance(mask, str)  # the kernel's softmax puts MLX's causal mask in itself
        if mask is not None and not causal:
            mask = mask if mask.dtype == mx.bool_ else mask.astype(mx.float32)
        if queries.shape[2] <= DECODE_QUERIES:
            if mask is not None and not causal:
                mask = mx.broadcast_to(mask, (*queries.shape[:3], keys.shape[2]))
            out: mx.array = kernel.attention_rows(queries, keys, values, scale, None if causal else mask, causal)
            return out
        q = mx.multiply(mx.array(scale, mx.float32), queries)
        heads, kv_heads = queries.shape[1], keys.shape[1]
        repeats = heads // kv_heads
        k, v = keys, values
        if repeats > 1:
            q, k, v = mx.unflatten(q, 1, (kv_heads, repeats)), mx.expand_dims(k, 2), mx.expand_dims(v, 2)
        scores = mx.matmul(q, mx.swapaxes(k, -1, -2))
        if mask is not None and not causal:
            if repeats > 1 and mask.ndim >= 3:
                mask = mx.expand_dims(mask, -3) if mask.shape[-3] == 1 else mx.unflatten(mask, -3, (kv_heads, repeats))
            if mask.dtype == mx.bool_:
                scores = mx.where(mask, scores, mx.array(mx.finfo(mx.float32).min, mx.float32))
            else:
                scores = mx.add(scores, mask)
        out = mx.matmul(kernel.softmax_rows(scores, causal), v)
        return mx.flatten(out, 1, 2) if repeats > 1 else out

    return attention


# The functions of mlx-lm's that its models call by a name of their own module (``from .activations import
# swiglu``), and the kernel's for each.
FUNCTIONS: dict[str, tuple[Callable[..., mx.array], Callable[[ModuleType], Callable[..., mx.array]]]] = {
    "swiglu": (activations.swiglu, kernel_swiglu),
    "scaled_dot_product_attention": (base.scaled_dot_product_attention, kernel_attention),
}


def _functions_through(model: nn.Module, kernel: ModuleType) -> tuple[str, ...]:
    """Point the names in ``FUNCTIONS`` of the mlx-lm modules that define ``model``'s layers at the kernel's; each
    as ``module.name``."""
    taken = []
    for module_name in sorted({type(layer).__module__ for _, layer in model.named_modules()}):
        module = sys.modules.get(module_name)
        for name, (original, through) in FUNCTIONS.items():
            called = getattr(module, name, None)
            if module is not None and (called is original or getattr(called, "through_kernel", False)):
                replacement = through(kernel)
                replacement.through_kernel = True  # type: ignore[attr-defined]
                setattr(module, name, replacement)
                taken.append(f"{module_name.rsplit('.', 1)[-1]}.{name}")
    return tuple(taken)


@dataclass(frozen=True, slots=True)
class Taken:
    """What of a model goes through the kernel: its quantized products (a fused group's once), norms and rotations,
    the functions of mlx-lm's its layers call (``module.function``), and the products whose weights it packed."""

    products: int
    norms: int
    rotations: int
    functions: tuple[str, ...] = ()
    packed: int = 0


def pack_layers(model: nn.Module, kernel: ModuleType) -> int:
    """Pack the weights of ``model``'s kernel products in place (``kernel.pack``), where the kernel was built with a
    packed product, and return how many it packed; call it as the model is loaded, before any graph reads them. An
    embedding's lookup reads its packed rows (``KernelEmbedding``), and its ``as_linear`` (a tied head) packed is
    the product's. A fused group's members compute from views of its rows: it is packed only where each member's
    rows are whole blocks, and its members are then marked packed too."""
    if not kernel.packs():
        return 0
    modules = dict(model.named_modules())
    followers: dict[int, list[nn.Module]] = {}  # by their group's shared pending outputs
    for module in modules.values():
        if isinstance(module, FusedFollower):
            followers.setdefault(id(module._pending), []).append(module)
    packed = 0
    for name, layer in modules.items():
        if type(layer) not in PACKED_CLASSES or name.endswith("._own"):
            continue
        if layer["weight"].shape[0] % PACKED_ROWS:
            continue
        lead = modules.get(name.removesuffix("._fused")) if name.endswith("._fused") else None
        if isinstance(lead, FusedLead) and any(cut % PACKED_ROWS for cut in lead._cuts):
            continue
        if not kernel.pack(layer["weight"], layer["scales"], layer["biases"]):
            continue  # a view of some columns (a slice of the inputs), left in MLX's layout
        layer.packed = True
        if isinstance(lead, FusedLead):
            for follower in followers.get(id(lead._pending), []):
                follower._own.packed = True
        packed += 1
    return packed


def use_kernel(model: nn.Module, kernel: ModuleType) -> Taken:
    """Send ``model``'s quantized products that the kernel takes, and its norms, rotations, gated activations and
    attention, through it."""
    parameters = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    norms = [array.dtype for name, array in parameters if name.endswith("norm.weight")]
    taken = {"products": 0, "norms": 0, "rotations": 0}
    for name, layer in model.named_modules():
        subclass = LAYER_CLASSES.get(type(layer))
        if subclass is None and type(layer) in PRODUCT_CLASSES and fits(layer):
            subclass = PRODUCT_CLASSES[type(layer)]
            layer.activations = norms[0] if norms else layer["scales"].dtype  # norms are never quantized
        if subclass is None:
            continue
        layer.__class__ = subclass  # the same arrays, names and checks; only the call differs
        layer.kernel = kernel
        if not name.endswith("._own"):  # a fused group's member alone: called only off the group's input
            taken[KINDS.get(subclass, "products")] += 1
    return Taken(**taken, functions=_functions_through(model, kernel), packed=pack_layers(model, kernel))
