"""GGUF block formats as neuron/models/gguf.py reads them, against llama.cpp's own decoder (gguf-py's
``quants.dequantize``): Q4_K's blocks repacked into MLX's affine 4-bit layout, and Q5_0's, Q5_1's and Q5_K's into
its 8-bit one, give exactly its values, as Q4_0's, Q4_1's and Q8_0's give exactly what MLX's own reader makes of
them; Q6_K and BF16, which MLX's layout does not hold, are its values in float32. The log says which formats stayed
quantized, which were dequantized, and what that cost. Their greedy text through neuron, kept quantized against
dequantized: tests/e2e/quantized/test_serving.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from structlog.testing import capture_logs

from neuron.models.gguf import _hf_name, _tensor, _unpermute, convert
from testkit import make_tiny_model
from testkit.gguf_files import write_gguf

HEADS, KV_HEADS = 4, 2  # make_tiny_model's


def _converted(source: Path, out: Path, dtype: str = "float32") -> tuple[dict[str, mx.array], dict[str, Any]]:
    """``source`` converted with its blocks kept quantized where MLX's layout holds them: the tensors, and the log's
    events by name."""
    from neuron import log

    try:
        log.configure("info", "json")  # whatever level an earlier test left
        with capture_logs() as logs:
            convert(source, out, dtype, quantized=True)
    finally:
        log.configure("warning", "json")
    weights = mx.load(str(out / "model.safetensors"))
    assert isinstance(weights, dict)
    return weights, {event["event"]: event for event in logs}


def _references(source: Path) -> dict[str, tuple[str, int, mx.array]]:
    """Each tensor of the file by neuron's name: its GGML type, its bytes in the file, and its values as gguf-py
    reads them, q/k rows in the order the converter puts them back in."""
    out = {}
    for tensor in gguf.GGUFReader(source).tensors:
        values = mx.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            values = _unpermute(values, HEADS if ".attn_q." in tensor.name else KV_HEADS)
        out[_hf_name(tensor.name)] = (tensor.tensor_type.name, int(tensor.n_bytes), values)
    return out


def _bits(out: Path, name: str) -> int:
    """A converted module's bits as the loader reads them: its own entry in the config's ``quantization``, else the
    common one."""
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    return int(quantization.get(name.removesuffix(".weight"), quantization)["bits"])


# The bits each block format is kept in.
KEPT = {"Q4_K": 4, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8}


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q5_0", "Q5_1", "Q5_K", "BF16"])
def test_a_block_is_kept_or_dequantized_exactly(tmp_path: Path, quant: str) -> None:
    """Q4_K_M: Q4_K kept in 4 bits (float32 scales: a float16 d times a 6-bit integer), Q6_K in float32; Q5_0, Q5_1
    and Q5_K (each 5-bit value a byte) kept in 8 bits, which MLX's reader refuses; BF16 (which it rounds to float16)
    in float32. The log counts what was kept and what not."""
    folder = make_tiny_model(tmp_path / "tiny", "llama", seed=7)
    source = write_gguf(folder, tmp_path / f"tiny-{quant}.gguf", "llama", quant=quant)
    weights, events = _converted(source, tmp_path / "out")
    kept: dict[str, int] = {}
    dequantized: dict[str, int] = {}
    for name, (kind, _, reference) in _references(source).items():
        base = name.removesuffix(".weight")
        if f"{base}.scales" in weights:
            scales, biases = weights[f"{base}.scales"], weights[f"{base}.biases"]
            assert scales.dtype == biases.dtype == mx.float32, name
            bits = _bits(tmp_path / "out", name)
            assert bits == KEPT[kind], (name, kind)
            values = mx.dequantize(weights[name], scales, biases, group_size=32, bits=bits)
            kept[kind] = kept.get(kind, 0) + 1
        else:
            values = weights[name]
            dequantized[kind] = dequantized.get(kind, 0) + 1
        assert values.dtype == mx.float32 and mx.array_equal(values, reference).item(), (name, kind)
    expected = {"Q4_K_M": ({"Q4_K"}, {"Q6_K", "F32"}), "BF16": (set(), {"BF16", "F32"})}
    assert (set(kept), set(dequantized)) == expected.get(quant, ({quant}, {"F32"}))
    said = events["gguf converted"]
    blocks = {kind: n for kind, n in dequantized.items() if kind not in ("F32", "BF16")}  # the block formats'
    assert said["quantized_formats"] == ",".join(f"{kind}:{n}" for kind, n in sorted(kept.items()))
    assert said["dequantized_formats"] == ",".join(f"{kind}:{n}" for kind, n in sorted(blocks.items()))
    assert ("gguf grew by dequantizing" in events) == (quant == "Q4_K_M")  # by Q6_K's 6.6 bits a value as 32


def test_on_an_accelerator_q4_k_scales_are_the_models_float16(tmp_path: Path) -> None:
    """float32 scales would turn every product, and so the residual stream and the KV cache, into float32."""
    folder = make_tiny_model(tmp_path / "tiny", "llama", seed=7)
    source = write_gguf(folder, tmp_path / "tiny-Q4_K_M.gguf", "llama", quant="Q4_K_M")
    weights, _ = _converted(source, tmp_path / "out", "float16")
    scales = [array for name, array in weights.items() if name.endswith((".scales", ".biases"))]
    assert scales and all(array.dtype == mx.float16 for array in scales)
    assert all(weights[name].dtype == mx.float16 for name in weights if name.endswith("v_proj.weight"))  # Q6_K


@pytest.mark.parametrize("quant", ["Q5_0", "Q5_1"])
def test_on_an_accelerator_q5_0_and_q5_1_stay_exact_in_float16(tmp_path: Path, quant: str) -> None:
    """Their scale d and bias (-16d, m) are float16 in the file, or a power of two away from one."""
    folder = make_tiny_model(tmp_path / "tiny", "llama", seed=7)
    source = write_gguf(folder, tmp_path / f"tiny-{quant}.gguf", "llama", quant=quant)
    weights, _ = _converted(source, tmp_path / "out", "float16")
    checked = 0
    for name, (kind, _, reference) in _references(source).items():
        base = name.removesuffix(".weight")
        if kind == quant:
            scales, biases = weights[f"{base}.scales"], weights[f"{base}.biases"]
            assert scales.dtype == biases.dtype == mx.float16, name
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
            values = mx.dequantize(weights[name], scales, biases, group_size=32, bits=8)
            assert mx.array_equal(values, reference).item(), name
            checked += 1
    assert checked > 20


def _q5_0_blocks(d: float, q: np.ndarray) -> np.ndarray:
    """Rows of Q5_0 blocks, all of scale ``d``, of the 5-bit values ``q`` (rows, blocks, 32): d, the fifth bits as a
    little-endian 32-bit word, value j's low bits in byte j's low nibble and value j + 16's in its high one."""
    qh = np.packbits(q >> 4, axis=-1, bitorder="little")
    qs = (q[..., :16] & 0xF) | ((q[..., 16:] & 0xF) << 4)
    scale = np.full((*q.shape[:-1], 1), d, np.float16).view(np.uint8)
    return np.concatenate([scale, qh, qs], axis=-1).reshape(q.shape[0], -1)


def test_a_bias_past_float16s_range_is_dequantized_there_and_kept_in_float32() -> None:
    """d = 4352: -16d is past 65504, every value d * (q - 16) within it (q in 8..24) and a multiple of 32, which
    float16 holds there."""
    q = np.random.default_rng(0).integers(8, 25, (4, 8, 32), dtype=np.uint8)
    data = _q5_0_blocks(4352.0, q)
    tensor: Any = SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=gguf.GGMLQuantizationType.Q5_0, data=data)
    reference = mx.array(gguf.quants.dequantize(data, tensor.tensor_type))
    assert mx.array_equal(reference, 4352 * (mx.array(q.reshape(4, -1)).astype(mx.float32) - 16)).item()
    half, bits = _tensor(tensor, mx.float16, quantized=True)
    assert bits is None and set(half) == {"weight"} and mx.array_equal(half["weight"], reference).item()
    kept, bits = _tensor(tensor, mx.float32, quantized=True)
    assert bits == 8 and kept["biases"].dtype == mx.float32
    values = mx.dequantize(kept["weight"], kept["scales"], kept["biases"], group_size=32, bits=8)
    assert mx.array_equal(values, reference).item()


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_mlxs_reader_holds_are_repacked_as_it_does(tmp_path: Path, quant: str) -> None:
    folder = make_tiny_model(tmp_path / "tiny", "qwen3", seed=7)  # a qwen3's q/k rows are as the file has them
    source = write_gguf(folder, tmp_path / f"tiny-{quant}.gguf", "qwen3", "qwen2", quant=quant)
    weights, _ = _converted(source, tmp_path / "out")
    mlx_read = mx.load(str(source), format="gguf")
    assert isinstance(mlx_read, dict)
    triples = [name for name in mlx_read if name.endswith(".scales")]
    assert len(triples) > 20
    for scales in triples:
        for leaf in ("weight", "scales", "biases"):
            name = scales.replace(".scales", f".{leaf}")
            ours, theirs = weights[_hf_name(name)], mlx_read[name]
            assert ours.dtype == theirs.dtype and mx.array_equal(ours, theirs).item(), name


def test_the_log_says_what_stayed_quantized_and_what_dequantizing_cost(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "tiny", "llama", seed=7)
    source = write_gguf(folder, tmp_path / "tiny-Q4_K_M.gguf", "llama", quant="Q4_K_M")
    weights, events = _converted(source, tmp_path / "out")
    references = _references(source).values()
    q4_k = [(size, values) for kind, size, values in references if kind == "Q4_K"]
    q6_k = [(size, values) for kind, size, values in references if kind == "Q6_K"]
    said = events["gguf converted"]
    assert said["quantized"] == len(q4_k) and said["quantized_formats"] == f"Q4_K:{len(q4_k)}"
    assert said["dequantized"] == len(q6_k) and said["dequantized_formats"] == f"Q6_K:{len(q6_k)}"
    assert said["dequantized_file_bytes"] == sum(size for size, _ in q6_k)
    assert said["dequantized_bytes"] == sum(values.size * 4 for _, values in q6_k)  # float32
    assert said["file_bytes"] == sum(size for size, _ in (*q4_k, *q6_k)) + sum(
        size for kind, size, _ in references if kind == "F32"
    )
    assert said["bytes"] == sum(array.nbytes for array in weights.values())
    # Q6_K's 6.6 bits a value as 32 added more than half the file, which a warning says, and what to do instead.
    assert said["dequantized_bytes"] - said["dequantized_file_bytes"] >= 0.5 * said["file_bytes"]
    grew = events["gguf grew by dequantizing"]
    assert grew["log_level"] == "warning" and grew["dequantized_formats"] == f"Q6_K:{len(q6_k)}"
    assert grew["bytes"] == said["bytes"] and grew["grew"] == round(said["bytes"] / said["file_bytes"], 1)
    assert "Q8_0" in grew["fix"]
