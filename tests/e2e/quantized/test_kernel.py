"""neuron's kernel for products against MLX's quantized weights (neuron/system/native/quantized.cpp), built here as
an MLX extension on first use, against MLX's own ``quantized_matmul`` on the same weights, and each SIMD path's
computing alone (kernel_check.cpp, NEON under qemu-user); its place in a real model
(``rank.model.kernels.use_kernel``), where a product through it equals MLX's; and the build's refusals, each saying
how to get it. Greedy text through ``neuron serve`` on every split: tests/e2e/quantized/test_serving.py.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import make_prompt_cache

from neuron.rank.model import fuse, kernels
from neuron.rank.rank import decode_queue
from neuron.system import cpu, native
from testkit import make_tiny_model


@pytest.fixture(scope="module")
def kernel() -> object:
    """The kernel as a rank builds it, for this machine's own instruction set; the other SIMD paths are checked
    without MLX (``test_each_simd_path_gives_the_product``)."""
    # The BLAS neuron preloads, where this machine has one, loaded as it is there (global): products of many rows
    # go through its cblas_sgemm.
    if (blas := cpu.find_blas()) is not None:
        ctypes.CDLL(blas, mode=ctypes.RTLD_GLOBAL)
    module, why = kernels.load_kernel(sorted(os.sched_getaffinity(0)))
    assert module is not None, why
    assert module.blas() == (blas is not None)  # type: ignore[attr-defined]
    return module


CHECK = Path(__file__).with_name("kernel_check.cpp")
ARM_CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
# Each SIMD path, as the compiler builds it for a machine that has no more: AVX-512 (this machine's own, where it has
# it), AVX2 with FMA and F16C (x86-64-v3), the plain loops (x86-64's baseline), and 64-bit ARM's NEON, run under
# qemu-user. With the flags of /proc/cpuinfo each x86 build needs to run here.
SIMD_PATHS = {
    "-march=native": set(),
    "-march=x86-64-v3": {"avx2", "fma", "f16c"},
    "-march=x86-64": set(),
    "aarch64 under qemu": set(),
}


@pytest.mark.parametrize("path", SIMD_PATHS)
def test_each_simd_path_gives_the_product(path: str, tmp_path: Path) -> None:
    # The kernel's computing alone (quantized.h), built by kernel_check.cpp against a plain reference: every layout
    # (4 and 8 bits, groups of 32, 64 and 128, float32, float16 and bfloat16 scales), 1 to 11 rows a pass, a product
    # shared among threads, a prompt's 100 rows through the BLAS where one is linked, and the half-float reads.
    tools = native.quantized_toolchain()
    if isinstance(tools, str):
        pytest.skip(tools)
    arm = path.startswith("aarch64")
    if arm:
        if shutil.which(ARM_CXX) is None or shutil.which(QEMU) is None:
            pytest.skip(f"needs {ARM_CXX} and {QEMU}: apt-get install g++-aarch64-linux-gnu qemu-user")
        compiler, flags, blas = ARM_CXX, ["-march=armv8-a"], []
    else:
        if platform.machine() != "x86_64":
            pytest.skip(f"an x86-64 build: this machine is {platform.machine()}")
        flags_here = set(Path("/proc/cpuinfo").read_text().split())
        if not SIMD_PATHS[path] <= flags_here:
            pytest.skip(f"this CPU lacks {', '.join(sorted(SIMD_PATHS[path] - flags_here))}")
        found = cpu.find_blas()
        compiler, flags, blas = tools.compiler, [path], ([] if found is None else ["-Wl,--no-as-needed", found])
    program = tmp_path / "kernel_check"
    include = [f"-I{native.QUANTIZED_CMAKE.parent}", f"-I{tools.mlx_dir / 'include'}"]
    build = [compiler, "-O2", "-std=c++20", "-fopenmp", *flags, *include, str(CHECK), *blas, "-o", str(program)]
    built = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    ran = subprocess.run([QEMU, "-L", "/usr/aarch64-linux-gnu", str(program)] if arm else [str(program)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    expected = "neon" if arm else {"-march=x86-64": "plain", "-march=x86-64-v3": "avx2"}.get(path)
    assert expected is None or ran.stdout.startswith(f"{expected}, "), ran.stdout
    assert (", BLAS linked:" in ran.stdout) == bool(blas), ran.stdout


def close(got: mx.array, want: mx.array) -> float:
    """The largest difference, relative to the largest value: float32 sums in another order differ in the last bits."""
    return (mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max() / mx.abs(want).max()).item()


def every_layout(test: Callable[..., None]) -> Callable[..., None]:
    """``test`` for each of MLX's affine layouts the kernel takes: 4 and 8 bits, groups of 32, 64 and 128, and
    float32, float16 or bfloat16 scales."""
    for name, values in (("scales", [mx.float32, mx.float16, mx.bfloat16]), ("group_size", [32, 64, 128]),
                         ("bits", [4, 8])):  # fmt: skip
        test = pytest.mark.parametrize(name, values)(test)
    return test


def quantized(weights: mx.array, bits: int, group_size: int, scales: mx.Dtype) -> tuple[mx.array, ...]:
    """``weights`` quantized in that layout."""
    w, s, b = mx.quantize(weights, group_size=group_size, bits=bits)
    return w, s.astype(scales), b.astype(scales)


@every_layout
def test_the_kernel_gives_mlxs_product_for_every_layout_and_row_count(
    kernel: object, bits: int, group_size: int, scales: mx.Dtype
) -> None:
    mx.random.seed(bits * group_size)
    n, k = 193, 3 * 128  # an odd column count: the helpers' shares of the columns differ
    w, s, b = quantized(mx.random.normal((n, k)), bits, group_size, scales)
    # One pass over the weights up to 8 rows, more passes beyond, and from 64 rows the BLAS path (``through_blas``).
    for rows in (1, 3, 8, 11, 40, 100):
        x = mx.random.normal((rows, k))
        want = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size, bits=bits)
        got = kernel.quantized_rows(x, w, s, b, group_size, bits)  # type: ignore[attr-defined]
        assert got.shape == (rows, n) and got.dtype == x.dtype
        assert close(got, want) < 2e-6, (rows, close(got, want))
    # Leading dimensions kept, and the rows' dtype. bfloat16 rows are summed in float32 and rounded once, which
    # MLX's bfloat16 product does not do: the reference is the float32 product, rounded.
    batched = mx.random.normal((2, 3, k)).astype(mx.bfloat16)
    got = kernel.quantized_rows(batched, w, s, b, group_size, bits)  # type: ignore[attr-defined]
    dense = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=bits)
    want = (batched.astype(mx.float32) @ dense.T).astype(mx.bfloat16)
    assert got.shape == (2, 3, n) and got.dtype == mx.bfloat16 and close(got, want) < 1e-2


def test_a_product_large_enough_to_share_among_the_helpers_gives_mlxs(kernel: object) -> None:
    mx.random.seed(11)
    n, k = 4099, 2048  # 8 MB of 8-bit weights (from SHARED_BYTES, quantized.h), an odd count of columns to share
    w, s, b = mx.quantize(mx.random.normal((n, k)), group_size=64, bits=8)
    for rows in (1, 8):
        x = mx.random.normal((rows, k))
        want = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=8)
        assert close(kernel.quantized_rows(x, w, s, b, 64, 8), want) < 2e-6  # type: ignore[attr-defined]


def test_the_kernel_reads_strided_rows_in_place_and_weights_in_a_strided_view(kernel: object) -> None:
    # Rows as a step hands them over (a transpose's, a reversed or every-other slice's, a broadcast's view) are
    # read where they lie, with no copy in MLX's graph first; weights in a strided view are made contiguous.
    mx.random.seed(7)
    n, k = 96, 256
    w, s, b = mx.quantize(mx.random.normal((n, k)), group_size=64, bits=4)
    strided_w = mx.concatenate([w, w], axis=1)[:, : w.shape[1]]
    views = {
        "transposed": mx.random.normal((k, 3)).T,
        "reversed": mx.random.normal((5, k))[::-1],
        "every other": mx.random.normal((6, 2 * k))[:, ::2],
        "broadcast": mx.broadcast_to(mx.random.normal((1, k)), (4, k)),
    }
    mx.eval(w, s, b, strided_w, *views.values())
    for name, x in views.items():
        want = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
        for weights in (w, strided_w):
            got = kernel.quantized_rows(x, weights, s, b, 64, 4)  # type: ignore[attr-defined]
            assert close(got, want) < 2e-6, name


def test_the_kernel_refuses_what_it_does_not_take(kernel: object) -> None:
    w, s, b = mx.quantize(mx.random.normal((64, 128)), group_size=64, bits=4)
    product = kernel.quantized_rows  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="4- or 8-bit"):
        product(mx.ones((1, 128)), *mx.quantize(mx.random.normal((64, 128)), group_size=64, bits=2), 64, 2)
    with pytest.raises(ValueError, match="do not match"):
        product(mx.ones((1, 96)), w, s, b, 64, 4)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        product(mx.ones((1, 128), dtype=mx.int32), w, s, b, 64, 4)


def test_a_quantized_model_takes_the_kernel_in_every_layer_it_fits_and_answers_as_mlx(
    kernel: object, tmp_path: Path
) -> None:
    folder = make_tiny_model(tmp_path / "tiny", "llama")
    model, _ = load(str(folder))
    nn.quantize(model, group_size=64, bits=4)
    fuse.fuse_projections(model)  # as a rank loads it: q, k and v one product, gate and up another
    tokens = mx.array([[1, 5, 9, 200, 3]])
    cache = make_prompt_cache(model)
    want = [model(tokens, cache=cache), model(tokens[:, :1], cache=cache)]  # a prompt, then a step at its offset
    mx.eval(want)  # before the weights are packed in place
    layers = len(model.model.layers)
    taken = kernels.use_kernel(model, kernel)  # type: ignore[arg-type]
    # Per layer o, down and the two fused groups, then the embedding and the head; two norms a layer and the last;
    # one rotation a layer (q's and k's); the gated activation and the attention that llama's module calls.
    assert "lm_head" in model
    # Packed where the kernel has a packed product: o, down, the two groups, the embedding and the head.
    packed = 4 * layers + 2 * (model["lm_head"]["weight"].shape[0] % kernels.PACKED_ROWS == 0) if kernel.packs() else 0  # type: ignore[attr-defined]
    assert taken == kernels.Taken(
        products=4 * layers + 2, norms=2 * layers + 1, rotations=layers, functions=FUNCTIONS, packed=packed
    )
    cache = make_prompt_cache(model)
    for got, expected in zip([model(tokens, cache=cache), model(tokens[:, :1], cache=cache)], want, strict=True):
        assert close(got, expected) < 1e-5
    assert model.parameters().keys() == load(str(folder))[0].parameters().keys()  # the same tree of names


def packed_copy(kernel: object, w: mx.array, scales: mx.array, biases: mx.array) -> tuple[mx.array, ...]:
    copies = tuple(a + 0 for a in (w, scales, biases))  # arrays of their own, packed in place
    mx.eval(*copies)
    kernel.pack(*copies)  # type: ignore[attr-defined]
    return copies


@every_layout
def test_packed_weights_give_mlxs_product_for_every_layout_and_row_count(
    kernel: object, bits: int, group_size: int, scales: mx.Dtype
) -> None:
    if not kernel.packs():  # type: ignore[attr-defined]
        pytest.skip("the kernel's packed product needs AVX-512")
    mx.random.seed(group_size)
    w, s, b = quantized(mx.random.normal((96, 384)) * 0.1, bits, group_size, scales)
    packed = packed_copy(kernel, w, s, b)
    for rows in (1, 2, 3, 8, 11, 100):  # one pass, a pass and some, and a prompt's through the BLAS
        x = mx.random.normal((rows, 384))
        want = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size, bits=bits)
        got = kernel.quantized_rows(x, *packed, group_size, bits, True)  # type: ignore[attr-defined]
        assert close(got, want) < 1e-5, rows
    assert not mx.array_equal(packed[0], w)  # packed in place, the shape kept
    assert packed[0].shape == w.shape


def test_a_packed_groups_member_computes_from_its_own_rows_alone(kernel: object, tmp_path: Path) -> None:
    """A fused group's member computes from views of the group's rows when called off the group's input: packed
    as whole blocks, they answer as the member's own weights."""
    model, _ = load(str(make_tiny_model(tmp_path / "tiny", "llama")))
    nn.quantize(model, group_size=64, bits=4)
    k_proj = model.model.layers[0].self_attn.k_proj
    x = mx.random.normal((1, 2, model.args.hidden_size))
    want = k_proj(x)
    mx.eval(want)  # before the weights are packed in place
    fuse.fuse_projections(model)
    kernels.use_kernel(model, kernel)  # type: ignore[arg-type]
    member = model.model.layers[0].self_attn.k_proj
    # Packed only where the kernel packs (AVX-512); elsewhere the views are of MLX's own layout.
    assert isinstance(member, fuse.FusedFollower)
    assert getattr(member._own, "packed", False) == kernel.packs()  # type: ignore[attr-defined]
    assert close(member(x), want) < 1e-5


@pytest.mark.parametrize("bits", [4, 8])
def test_a_packed_embedding_looks_up_mlxs_rows_and_projects_as_a_tied_head(kernel: object, bits: int) -> None:
    if not kernel.packs():  # type: ignore[attr-defined]
        pytest.skip("the kernel's packed product needs AVX-512")
    mx.random.seed(bits)
    embedding = nn.QuantizedEmbedding(64, 96, group_size=32, bits=bits)
    ids, x = mx.array([[0, 17, 63, 5], [16, 15, 31, 2]]), mx.random.normal((3, 96))
    want = [embedding(ids), embedding.as_linear(x)]
    mx.eval(want)  # before the weights are packed in place
    holder = nn.Module()
    holder.embed = embedding
    holder.norm = nn.RMSNorm(96)  # the activations' dtype, as a model's norms give it
    assert kernels.use_kernel(holder, kernel).packed == 1  # type: ignore[arg-type]
    assert holder.embed.packed
    assert mx.array_equal(holder.embed(ids), want[0])
    assert close(holder.embed.as_linear(x), want[1]) < 1e-5


def test_packing_refuses_what_it_cannot_take_saying_why(kernel: object) -> None:
    if not kernel.packs():  # type: ignore[attr-defined]
        pytest.skip("the kernel's packed product needs AVX-512")
    w, s, b = mx.quantize(mx.random.normal((40, 64)), group_size=32, bits=4)
    with pytest.raises(ValueError, match="blocks of 16"):
        kernel.pack(w, s, b)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="blocks of 16"):
        kernel.quantized_rows(mx.ones((1, 64)), w, s, b, 32, 4, True)  # type: ignore[attr-defined]


def test_the_norm_and_the_rotation_are_mlxs_in_one_node(kernel: object) -> None:
    mx.random.seed(3)
    x, weight = mx.random.normal((3, 5, 96)), mx.random.normal((96,))
    assert mx.array_equal(kernel.rms_norm_rows(x, weight, 1e-5), mx.fast.rms_norm(x, weight, 1e-5))  # type: ignore[attr-defined]
    # As attention hands them over: [B, heads, T, D] transposed from [B, T, heads, D]; one offset, or one a row.
    queries = mx.random.normal((2, 7, 4, 64)).transpose(0, 2, 1, 3)
    for traditional in (False, True):
        for offset in (mx.array(37, dtype=mx.int32), mx.array([3, 900], dtype=mx.int32)):
            for dims, base, scale in ((64, 100000.0, 1.0), (32, 10000.0, 0.5)):  # a partial rotation, scaled
                want = mx.fast.rope(queries, dims, traditional=traditional, base=base, scale=scale, offset=offset)
                got = kernel.rotary_rows(queries, offset, dims, traditional, base, scale)  # type: ignore[attr-defined]
                # The C library's sines and cosines of angles up to ~1,000 radians differ from MLX's own by a few of
                # the angle's float32 steps (~6e-5 there); a wrong pairing, position or frequency misses by far more.
                assert close(got, want) < 3e-5, (traditional, offset, dims)
    with pytest.raises(ValueError, match="float32"):
        kernel.rotary_rows(queries.astype(mx.float16), offset, 64, False, 1e4, 1.0)  # type: ignore[attr-defined]


def test_the_gated_activation_is_mlx_lms_bit_for_bit_in_one_node(kernel: object) -> None:
    # As a fused gate/up product hands them over: two halves of one array, rows a whole product apart.
    mx.random.seed(5)
    fused = mx.random.normal((2, 3, 2 * 1536)) * 8
    gate, up = fused[..., :1536], fused[..., 1536:]
    assert mx.array_equal(kernel.swiglu_rows(gate, up), swiglu(gate, up))  # type: ignore[attr-defined]
    # A fine grid of gates over the range where exp is neither 0 nor infinite, its ends, and values that are no
    # number.
    fine = mx.arange(-(2**21), 2**21, dtype=mx.float32) / 2**15
    assert mx.array_equal(kernel.swiglu_rows(fine, fine), swiglu(fine, fine))  # type: ignore[attr-defined]
    ends = mx.array([0.0, -0.0, 1e-30, 60.9, 61.1, -60.9, -61.1, 1e4, -1e4, float("inf"), -float("inf"), float("nan")])
    assert mx.array_equal(kernel.swiglu_rows(ends, ends + 1), swiglu(ends, ends + 1), equal_nan=True)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="one shape"):
        kernel.swiglu_rows(gate, up[..., :8])  # type: ignore[attr-defined]


def test_the_softmax_is_mlxs_bit_for_bit_in_one_node(kernel: object) -> None:
    mx.random.seed(6)
    for shape in ((1, 9, 1, 37), (2, 3, 5, 700), (1, 1, 1, 1), (1, 9, 64, 513)):
        x = mx.random.normal(shape) * 10
        assert mx.array_equal(kernel.softmax_rows(x), mx.softmax(x, axis=-1, precise=True)), shape  # type: ignore[attr-defined]
    # A value that is no number, a row of -inf, a masked row's float32 minimum, zeros of both signs.
    ends = mx.array([[1.0, float("nan"), 3.0], [-float("inf")] * 3, [-3.4e38, 0.0, -3.4e38], [0.0, -0.0, 0.0]])
    assert mx.array_equal(kernel.softmax_rows(ends), mx.softmax(ends, axis=-1), equal_nan=True)  # type: ignore[attr-defined]
    assert mx.array_equal(kernel.softmax_rows(x.T), mx.softmax(x.T, axis=-1))  # type: ignore[attr-defined]  # strided rows


@pytest.mark.parametrize("queries, keys", [(5, 9), (1, 7), (9, 9), (9, 5)])
def test_the_causal_softmax_is_mlxs_masked_softmax_bit_for_bit(kernel: object, queries: int, keys: int) -> None:
    # MLX's fallback: the keys after each query (the queries being the last of the keys) set to float32's lowest,
    # then the softmax. More queries than keys leaves the first rows wholly masked.
    mx.random.seed(8)
    x = mx.random.normal((2, 3, queries, keys)) * 10
    x[0, 1, -1, 0] = float("nan")  # a row holding no number
    x[1, 2, 0, 0] = -float("inf")
    offset = keys - queries
    seen = mx.expand_dims(mx.arange(offset, queries + offset), 1) >= mx.expand_dims(mx.arange(0, keys), 0)
    want = mx.softmax(mx.where(seen, x, mx.array(mx.finfo(mx.float32).min, mx.float32)), axis=-1, precise=True)
    assert mx.array_equal(kernel.softmax_rows(x, True), want, equal_nan=True)  # type: ignore[attr-defined]


# Each shape as mlx-lm's attention meets it: (batch, heads, key/value heads, queries, keys) and the mask. A prompt's
# queries, more than ``DECODE_QUERIES``, go through MLX's fallback with the kernel's softmax.
PROMPTS = {
    "a prompt": ((1, 9, 3, 17, 17), "causal"),
    "a prompt's later chunk": ((1, 9, 3, 12, 50), "causal"),
    "a padded batch": ((2, 9, 3, 12, 30), "bool"),
    "an additive mask per head": ((2, 9, 3, 12, 30), "float"),
}
# A few queries a head, one node (``attention_rows``).
STEPS = {
    "a decode step, heads sharing keys": ((1, 9, 3, 1, 40), None),
    "a batch, one head each": ((2, 4, 4, 1, 30), None),
    "a padded batch": ((2, 9, 3, 1, 30), "bool"),
    "an additive mask per head": ((2, 9, 3, 2, 30), "float"),
    "a speculative step's drafts": ((1, 9, 3, 5, 50), "causal"),
    "more queries than keys": ((1, 2, 1, 8, 5), "causal"),
    "a long context, its key heads over the cores": ((2, 9, 3, 1, 2500), "bool"),
    # Query rows a block at a time where heads are 64 or 128 wide (AVX-512), the last block short; else row by row.
    "heads 128 wide, drafts": ((1, 8, 2, 3, 40, 128), "causal"),
    "heads 128 wide, three rows a key head": ((2, 6, 2, 1, 33, 128), "bool"),
    "heads 32 wide": ((1, 4, 2, 2, 20, 32), None),
}


def attention_case(shape: tuple[int, ...], mask: object) -> tuple[mx.array, mx.array, mx.array, object]:
    """Queries, keys and values of ``shape`` (heads 64 wide unless it gives a width); the keys and values, as a cache
    gives them, views of a longer buffer."""
    batch, heads, kv_heads, queries, keys, width = (*shape, 64)[:6]
    mx.random.seed(7)
    q = mx.random.normal((batch, heads, queries, width))
    k = mx.random.normal((batch, kv_heads, keys + 11, width))[:, :, :keys]
    v = mx.random.normal((batch, kv_heads, keys + 11, width))[:, :, :keys]
    if mask == "bool":
        mask = mx.random.uniform(shape=(batch, 1, queries, keys)) > 0.3
    elif mask == "float":
        mask = mx.random.normal((batch, heads, queries, keys))
    return q, k, v, mask


@pytest.mark.parametrize("case", PROMPTS)
def test_a_prompts_attention_through_the_kernel_is_mlxs_bit_for_bit(kernel: object, case: str) -> None:
    q, k, v, mask = attention_case(*PROMPTS[case])
    got = kernels.kernel_attention(kernel)(q, k, v, None, 0.125, mask)  # type: ignore[arg-type]
    assert mx.array_equal(got, mlx_lm_base.scaled_dot_product_attention(q, k, v, None, scale=0.125, mask=mask))


@pytest.mark.parametrize("case", STEPS)
def test_a_steps_attention_is_one_node_giving_mlxs_to_float32s_rounding(
    kernel: object, case: str, tmp_path: Path
) -> None:
    """Its sums are the kernel's, in an order of their own: equal to MLX's to the last bits, not in them."""
    q, k, v, mask = attention_case(*STEPS[case])
    got = kernels.kernel_attention(kernel)(q, k, v, None, 0.125, mask)  # type: ignore[arg-type]
    mx.export_to_dot(str(tmp_path / "attention.dot"), got)  # before it is evaluated, when it has a graph
    nodes = set((tmp_path / "attention.dot").read_text().replace('"', " ").split())
    assert "AttentionRows" in nodes and not nodes & {"Matmul", "SoftmaxRows", "Softmax"}
    want = mlx_lm_base.scaled_dot_product_attention(q, k, v, None, scale=0.125, mask=mask)
    assert got.shape == want.shape
    assert close(got, want) < 1e-6


def test_a_steps_attention_refuses_what_it_cannot_take_saying_why(kernel: object) -> None:
    q, k, v, _ = attention_case((1, 9, 3, 1, 40), None)
    with pytest.raises(ValueError, match="divide"):
        kernel.attention_rows(q, k[:, :2], v[:, :2], 0.125)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="broadcast it"):
        kernel.attention_rows(q, k, v, 0.125, mx.ones((1, 1, 1, 40), mx.bool_))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="not both"):
        kernel.attention_rows(q, k, v, 0.125, mx.ones((1, 9, 1, 40), mx.bool_), True)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="float32"):
        kernel.attention_rows(q.astype(mx.float16), k, v, 0.125)  # type: ignore[attr-defined]


FUNCTIONS = ("llama.swiglu", "llama.scaled_dot_product_attention")


def test_a_model_loaded_with_the_kernel_calls_its_activation_and_attention_through_it(
    kernel: object, tmp_path: Path
) -> None:
    model, _ = load(str(make_tiny_model(tmp_path / "tiny", "llama")))
    layer = model.layers[0]
    module = importlib.import_module(type(layer).__module__)
    step, prompt = mx.array([[1, 5, 9, 200, 3]]), mx.array([list(range(1, 13))])  # a few queries, and many
    x = mx.random.normal((1, 3, model.args.hidden_size))
    before = (layer.mlp(x), model(step), model(prompt))
    try:
        assert kernels.use_kernel(model, kernel).functions == FUNCTIONS  # type: ignore[arg-type]
        after = (layer.mlp(x), model(step), model(prompt))
        expected = (("step", after[1], {"SwiGLURows", "AttentionRows"}), ("prompt", after[2], {"SoftmaxRows"}))
        for name, out, nodes in expected:
            mx.export_to_dot(str(tmp_path / f"{name}.dot"), out)
            assert nodes <= set((tmp_path / f"{name}.dot").read_text().replace('"', " ").split()), name
        assert mx.array_equal(after[0], before[0])
        assert close(after[1], before[1]) < 3e-5  # the rotations' sines are the C library's (above)
        assert close(after[2], before[2]) < 3e-5
    finally:
        module.swiglu, module.scaled_dot_product_attention = swiglu, mlx_lm_base.scaled_dot_product_attention


# As in a rank alone: its thread is pinned to one core before the kernel loads (OpenMP's runtime with it), and MLX's
# stream thread, started from it, runs the products.
PINNED_RANK = """
import os, sys, threading
from neuron.rank.model import kernels
cores = sorted(os.sched_getaffinity(0))
seen = []
def stream():
    seen.append(kernel.threads())
def rank():
    global kernel
    os.sched_setaffinity(0, cores[:1])
    kernel, why = kernels.load_kernel(cores)
    assert kernel is not None, why
    thread = threading.Thread(target=stream)
    thread.start()
    thread.join()
thread = threading.Thread(target=rank)
thread.start()
thread.join()
print(seen[0])
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores for a product to share")
def test_a_product_on_a_pinned_ranks_stream_thread_shares_the_ranks_cores(kernel: object) -> None:
    ran = subprocess.run([sys.executable, "-c", PINNED_RANK], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert int(ran.stdout) == len(os.sched_getaffinity(0))


def test_without_a_compiler_or_turned_off_there_is_no_kernel_and_the_reason_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler, no CMake on it
    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path / "cache"))
    built = native.build_quantized()
    assert built.path is None and "no C++ compiler found: install a C++ compiler" in built.problem
    monkeypatch.setenv(native.QUANTIZED_ENV, "off")
    assert native.build_quantized().problem == f"{native.QUANTIZED_ENV}=off"
    assert kernels.load_kernel([0]) == (None, f"{native.QUANTIZED_ENV}=off")


def test_every_source_of_the_kernel_names_its_build() -> None:
    """The build is cached by its sources' bytes (``native.build_quantized``): a file left out could change and leave
    the kernel built from its old self, as ``cpu_eval.h`` once was."""
    folder = native.QUANTIZED_CMAKE.parent
    sources = {p.name for p in folder.iterdir() if p.suffix in (".cpp", ".h")}
    assert sources == {p.name for p in native.QUANTIZED_SOURCES}


def test_a_folder_named_mlx_where_neuron_starts_leaves_the_build_mlxs_own_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # MLX is a namespace package: ``python -m neuron`` started in a folder holding an ``mlx`` folder adds it to
    # MLX's search path ahead of the wheel's, and the build once looked there for MLX's CMake files.
    (tmp_path / "mlx").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = native.quantized_toolchain()
    if isinstance(tools, str):
        pytest.skip(tools)
    assert (tools.mlx_dir / native.MLX_CMAKE / "MLXConfig.cmake").is_file(), tools.mlx_dir


def queued_in(kernel: object, lone: bool) -> float:
    """Seconds ``mx.async_eval`` held its caller over a slow product followed by 400 operations on its result (about
    100 of MLX's tasks), within ``decode_queue`` for a step ``lone`` or not; the product is waited for after."""
    a = mx.random.normal((1024, 1024))
    mx.eval(a)
    x = (a @ a)[0, :8]
    for _ in range(400):
        x = x + 1
    start = time.perf_counter()
    with decode_queue(kernel, lone):  # type: ignore[arg-type]
        mx.async_eval(x)
    held = time.perf_counter() - start
    mx.eval(x)
    return held


def test_a_lone_decode_step_is_queued_whole_and_others_as_mlx_queues_them(kernel: object) -> None:
    # MLX holds its caller while more than ten tasks are queued: the 400 operations wait on the product, which runs
    # first. A step that decodes one sequence queues them all and returns at once; any other step, and any
    # evaluation after it (the allowance is taken back), waits as MLX makes it.
    other = queued_in(kernel, False)
    lone = queued_in(kernel, True)
    after = queued_in(kernel, False)
    assert lone < min(other, after) / 4, (other, lone, after)
