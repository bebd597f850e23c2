"""Convert a GGUF file (llama and Mistral, Qwen2, Qwen3, Gemma) into an MLX model folder, once.

llama.cpp's own reader (gguf-py's ``GGUFReader``) maps the file; no llama.cpp
code runs. Each tensor's blocks are repacked into MLX's quantized layout where
it holds them exactly (Q4_0, Q4_1 and Q4_K in 4 bits; Q8_0, Q5_0, Q5_1 and Q5_K
in 8), or dequantized exactly (gguf-py's numpy decoders: Q6_K, Q3_K, ...). This
module renames tensors to the Hugging Face names mlx-lm expects, undoes what
llama.cpp's converter changed (the rotary permutation of llama's q/k rows, the
1 it adds to Gemma's norms), and rebuilds the tokenizer and chat template from
the metadata.

Why not ``mx.load``, which reads GGUF too: its reader (gguflib) gets Q4_K's odd
sub-blocks wrong (each takes its even neighbour's scale and min), rounds Q6_K
and BF16 to float16, and refuses a whole file for one Q5_K or Q5_0 tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog

from neuron.log import ms_since
from neuron.models.progress import Meter
from neuron.system import cpu
from neuron.system.native import QUANTIZED_FIX, quantized_toolchain
from neuron.system.paths import cache_dir

if TYPE_CHECKING:
    from collections.abc import Callable

    import mlx.core as mx
    import numpy as np
    from gguf import GGUFReader, ReaderTensor

log = structlog.get_logger("neuron.gguf")


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Part of a converted folder's cache key: bump it when the conversion changes what it writes.
CONVERTER_VERSION = 5


@dataclass(frozen=True, slots=True)
class Arch:
    """How a GGUF architecture maps onto mlx-lm's model of the same shape."""

    model_type: str
    hf_class: str
    permuted: bool  # llama.cpp's converter interleaved the rotary halves of q/k rows (llama's rope layout)
    norm_offset: float = 0.0  # llama.cpp's converter added this to every norm weight (Gemma's 1 + w)


# By ``general.architecture``; the GGUF's metadata keys start with that name. Any other is refused by name.
# llama.cpp writes Mistral's models (7B, Nemo) as llama; its gemma2, gemma3 and mistral3 need more than this.
ARCHS = {
    "llama": Arch("llama", "LlamaForCausalLM", permuted=True),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", permuted=False),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", permuted=False),
    "gemma": Arch("gemma", "GemmaForCausalLM", permuted=False, norm_offset=1.0),
}


class GGUFError(ValueError):
    pass


def _hf_name(name: str) -> str:
    base, _, leaf = name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{leaf}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{leaf}"
    raise GGUFError(f"unexpected tensor {name!r}: neuron does not know where it goes")


def _unpermute(weight: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's per-head interleaving of the rotary halves of q/k rows."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


# MLX's affine layout in groups of 32 values: a Q4_0, Q4_1, Q8_0, Q5_0 or Q5_1 block is one group, a Q4_K or Q5_K
# super-block eight.
_GROUP = 32


class Affine(NamedTuple):
    """Blocks as MLX's affine layout holds them: value = scale * q + bias, a scale and a bias per group of 32."""

    words: np.ndarray  # uint32: 32 // bits values a word, the first in the lowest bits
    scales: np.ndarray
    biases: np.ndarray
    bits: int


def _halves(field: np.ndarray) -> np.ndarray:
    """A block's float16 field (its two bytes, last axis) as one float16 a block."""
    import numpy as np

    return np.ascontiguousarray(field).view(np.float16)[..., 0]


def _words(q: np.ndarray, bits: int) -> np.ndarray:
    """Values (uint8, a row's in order on the axes after the first) packed into MLX's uint32 words: at 4 bits two a
    byte, the first in the low nibble; bytes little-endian within a word (checked against mx.dequantize)."""
    import numpy as np

    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return np.ascontiguousarray(q).reshape(q.shape[0], -1).view("<u4")


def _q4_0(blocks: np.ndarray) -> Affine:
    """18 bytes: d (float16), then 16 bytes holding value j in the low nibble of byte j, value j + 16 in its high
    nibble; value = d * (q - 8), so the bias -8d is as exact in float16 as d is."""
    import numpy as np

    d, qs = _halves(blocks[..., :2]), blocks[..., 2:]
    with np.errstate(over="ignore"):  # an infinite bias is ``_tensor``'s to find
        bias = d * np.float16(-8)
    return Affine(_words(np.concatenate([qs & 0xF, qs >> 4], axis=-1), 4), d, bias, 4)


def _q4_1(blocks: np.ndarray) -> Affine:
    """20 bytes: d and m (float16), then Q4_0's nibbles; value = d * q + m."""
    import numpy as np

    d, m, qs = _halves(blocks[..., :2]), _halves(blocks[..., 2:4]), blocks[..., 4:]
    return Affine(_words(np.concatenate([qs & 0xF, qs >> 4], axis=-1), 4), d, m, 4)


def _q8_0(blocks: np.ndarray) -> Affine:
    """34 bytes: d (float16), then 32 signed bytes; value = d * q = d * (q + 128) - 128d, MLX's words unsigned."""
    import numpy as np

    d = _halves(blocks[..., :2])
    with np.errstate(over="ignore"):  # an infinite bias is ``_tensor``'s to find
        bias = d * np.float16(-128)
    return Affine(_words(blocks[..., 2:] ^ np.uint8(0x80), 8), d, bias, 8)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K or Q5_K super-block's eight sub-blocks' scales d * sc and biases -dmin * m, float32 (exact: an 11-bit
    significand times a 6-bit integer), from its d and dmin (float16) and the twelve bytes of (sc, m) pairs after."""
    import numpy as np

    d, dmin = _halves(blocks[..., :2]).astype(np.float32), _halves(blocks[..., 2:4]).astype(np.float32)
    low, mid, high = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    # As ggml's get_scale_min_k4: pairs 0-3 in the low six bits of the first eight bytes; pairs 4-7 in the last
    # four bytes' nibbles, their top two bits in those eight bytes' top two.
    sc = np.concatenate([low & 63, (high & 0xF) | (low >> 6 << 4)], axis=-1)
    m = np.concatenate([mid & 63, (high >> 4) | (mid >> 6 << 4)], axis=-1)
    rows = blocks.shape[0]
    return (d[..., None] * sc).reshape(rows, -1), (-(dmin[..., None] * m)).reshape(rows, -1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """A super-block's 128 bytes of low nibbles as its eight sub-blocks' (axis -2): four runs of 32 bytes, each
    holding sub-block 2r in its low nibbles and sub-block 2r + 1 in its high ones."""
    import numpy as np

    runs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([runs & 0xF, runs >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(blocks: np.ndarray) -> Affine:
    """144 bytes a super-block of 256 values: d and dmin (float16), twelve bytes of eight 6-bit (sc, m) pairs, then
    the 128 bytes of nibbles; value = d * sc * q - dmin * m."""
    scales, biases = _k_scales(blocks)
    return Affine(_words(_k_nibbles(blocks[..., 16:]), 4), scales, biases, 4)


def _q5_nibbles(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """A Q5_0 or Q5_1 block's 32 five-bit values: value j's low four bits in byte j's low nibble, value j + 16's in
    its high one; value j's fifth bit is bit j of the little-endian 32-bit word qh (as ggml's dequantize_row_q5_0)."""
    import numpy as np

    fifth = np.unpackbits(qh, axis=-1, bitorder="little")
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1) | (fifth << 4)


# Five-bit values are kept as MLX's 8-bit layout, groups of 32: each in a byte of its own, with the block's scale and
# bias as the group's. The 3 bits of a value left unused cost less than dequantizing (8 + 2 bits a value against 32).


def _q5_0(blocks: np.ndarray) -> Affine:
    """22 bytes: d (float16), qh (4 bytes), 16 bytes of nibbles; value = d * (q - 16). The bias -16d is exact in
    float32, and in float16 as long as it does not overflow there (``_tensor`` checks)."""
    import numpy as np

    d = _halves(blocks[..., :2]).astype(np.float32)
    return Affine(_words(_q5_nibbles(blocks[..., 2:6], blocks[..., 6:]), 8), d, d * np.float32(-16), 8)


def _q5_1(blocks: np.ndarray) -> Affine:
    """24 bytes: d and m (float16), then Q5_0's qh and nibbles; value = d * q + m."""
    import numpy as np

    d, m = _halves(blocks[..., :2]).astype(np.float32), _halves(blocks[..., 2:4]).astype(np.float32)
    return Affine(_words(_q5_nibbles(blocks[..., 4:8], blocks[..., 8:]), 8), d, m, 8)


def _q5_k(blocks: np.ndarray) -> Affine:
    """176 bytes a super-block of 256 values: Q4_K's d, dmin and (sc, m) pairs, 32 bytes qh, then Q4_K's 128 bytes
    of nibbles; value = d * sc * q - dmin * m. Unlike Q5_0's, the fifth bit of sub-block i's value l is bit i of
    qh's byte l (as ggml's dequantize_row_q5_K)."""
    import numpy as np

    scales, biases = _k_scales(blocks)
    qh = blocks[..., 16:48, None]  # byte l's bit i, unpacked little-endian onto the last axis: sub-block i's value l
    fifth = np.unpackbits(qh, axis=-1, bitorder="little").swapaxes(-1, -2)
    return Affine(_words(_k_nibbles(blocks[..., 48:]) | (fifth << 4), 8), scales, biases, 8)


# The block formats MLX's affine layout holds exactly, by GGML type name; every other one is dequantized.
_REPACKS: dict[str, Callable[[np.ndarray], Affine]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q5_K": _q5_k,
}
# What gguf-py's decoders read, as a refused tensor type's message names it.
_READ = "F32, F16, BF16 and the block formats (Q4_0 ... Q8_0, the K-quants, the IQ ones)"


@dataclass
class Tally:
    """A format's tensors: how many, their bytes in the file, and theirs once converted."""

    tensors: int = 0
    file_bytes: int = 0
    bytes: int = 0


def _tallied(tallies: dict[str, Tally]) -> str:
    """``Q4_K:169,Q6_K:25``: a log field's value that reads the same in JSON, on a console and in the journal."""
    return ",".join(f"{kind}:{tally.tensors}" for kind, tally in sorted(tallies.items()))


def _tensor(tensor: ReaderTensor, dtype: mx.Dtype, quantized: bool) -> tuple[dict[str, mx.array], int | None]:
    """One tensor's arrays and, where its blocks are kept in MLX's layout (``quantized`` and a format it holds), their
    bits: ``weight``, ``scales`` and ``biases``; else ``weight`` alone in ``dtype``, dequantized in float32 first."""
    import gguf as ggml
    import mlx.core as mx

    kind, data = tensor.tensor_type, tensor.data
    repack = _REPACKS.get(kind.name)
    if quantized and repack is not None:
        _, size = ggml.GGML_QUANT_SIZES[kind]
        affine = repack(data.reshape(data.shape[0], -1, size))
        # Q4_0's, Q4_1's and Q8_0's scales are exact in float16, as the file holds them. The others' (float32) go to
        # the model's dtype: exact on a Linux CPU; on an accelerator float16, where Q5_0's and Q5_1's stay exact and
        # the K-quants' d * sc and dmin * m round as every weight dequantized there does. MLX would take float32
        # scales with float16 inputs, but its products would then be float32, and so the residual stream and the
        # KV cache, at twice the memory.
        scales, biases = (mx.array(a) for a in (affine.scales, affine.biases))
        if scales.dtype != mx.float16:
            scales, biases = scales.astype(dtype), biases.astype(dtype)
        # A bias (-8d, -16d, -128d) or a K-quant's product past float16's 65504 is infinite there, and so would be
        # every value of its group: such a tensor is dequantized instead, its values as exact as the dtype holds.
        if mx.all(mx.isfinite(scales) & mx.isfinite(biases)).item():
            return {"weight": mx.array(affine.words), "scales": scales, "biases": biases}, affine.bits
    if kind.name in ("F32", "F16"):
        return {"weight": mx.array(data).astype(dtype)}, None
    try:
        dense = ggml.quants.dequantize(data, kind)
    except NotImplementedError:
        raise GGUFError(f"tensor {tensor.name} is {kind.name}, which neuron does not read: it reads {_READ}") from None
    return {"weight": mx.array(dense).astype(dtype)}, None


@dataclass
class Converted:
    """A file's tensors under mlx-lm's names, each module kept quantized with its layout (as a config's
    ``quantization`` names them), and per GGML block format, what was kept quantized and what dequantized."""

    weights: dict[str, mx.array]
    layouts: dict[str, dict[str, int]]
    kept: dict[str, Tally]
    dequantized: dict[str, Tally]


def _weights(
    tensors: list[ReaderTensor], arch: Arch, heads: int, kv_heads: int, dtype: mx.Dtype, quantized: bool
) -> Converted:
    """The file's tensors converted (``_tensor``): its block formats MLX's layout holds kept so where ``quantized``,
    the others in ``dtype``."""
    import gguf as ggml
    import mlx.core as mx

    done = Converted({}, {}, {}, {})
    with Meter("converting", sum(int(t.n_bytes) for t in tensors)) as meter:
        for tensor in tensors:
            base = tensor.name.removesuffix(".weight")
            parts, bits = _tensor(tensor, dtype, quantized)
            for leaf, array in parts.items():  # a row's scales and biases move with its words
                if arch.permuted and base.endswith(".attn_q"):
                    array = _unpermute(array, heads)
                elif arch.permuted and base.endswith(".attn_k"):
                    array = _unpermute(array, kv_heads)
                elif arch.norm_offset and base.endswith("norm"):
                    array = array - arch.norm_offset
                mx.eval(array)
                done.weights[_hf_name(tensor.name if leaf == "weight" else f"{base}.{leaf}")] = array
            if bits is not None:
                done.layouts[_hf_name(tensor.name).removesuffix(".weight")] = {"group_size": _GROUP, "bits": bits}
            if ggml.GGML_QUANT_SIZES[tensor.tensor_type][0] > 1:  # a block format, not a float one
                tally = (done.kept if bits else done.dequantized).setdefault(tensor.tensor_type.name, Tally())
                tally.tensors += 1
                tally.file_bytes += int(tensor.n_bytes)
                tally.bytes += sum(a.nbytes for a in parts.values())
            meter.advance(int(tensor.n_bytes))
    return done


# Pre-tokenizer splits by ``tokenizer.ggml.pre``, as the models' own tokenizer.json files hold them.
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
_REST = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLIT_REGEX = {
    "qwen2": rf"{_LETTERS}|\p{{N}}|{_REST}",
    "llama-bpe": rf"{_LETTERS}|\p{{N}}{{1,3}}|{_REST}",
}


def _tokenizer_json(meta: dict[str, Any]) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") == "llama":
        return _sentencepiece_json(meta)
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise GGUFError(
            "only byte-level BPE (gpt2) and SentencePiece BPE (llama) tokenizers are supported, not "
            f"{meta.get('tokenizer.ggml.model')!r}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]  # none: bytes alone
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre")
    if pre == "smollm":
        # SmolLM splits every digit on its own before the byte-level regex.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _SPLIT_REGEX:  # the split the model's own tokenizer.json makes, then bytes without GPT-2's regex
        split = pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated", invert=False)
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, no_regex])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    kinds: list[int] = meta["tokenizer.ggml.token_type"]
    # Token types 3 (control) and 4 (user-defined) are special: matched whole, never split.
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, kind in enumerate(kinds) if kind in (3, 4)]
    )
    return tokenizer.to_str()


def _sentencepiece_json(meta: dict[str, Any]) -> str:
    """A SentencePiece BPE vocabulary (llama.cpp's ``llama`` tokenizer: Llama 2's, Mistral's, Gemma's) as the
    tokenizers library runs it, built the way transformers converts a SentencePiece model: merges from the
    pieces (every split of a piece into two pieces, ranked by the whole piece's score), bytes for what no piece
    covers, "▁" for spaces and one before the text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores: list[float] = meta["tokenizer.ggml.scores"]
    kinds: list[int] = meta["tokenizer.ggml.token_type"]
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score, kind in zip(tokens, scores, kinds, strict=True):
        if kind != 1:  # normal pieces only: control, unknown and byte tokens are never merged into
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    unknown = int(meta["tokenizer.ggml.unknown_token_id"]) if "tokenizer.ggml.unknown_token_id" in meta else 0
    model = models.BPE(
        vocab=vocab,
        merges=[(left, right) for *_, left, right in ranked],
        unk_token=tokens[unknown],
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    # As Llama 2's own tokenizer.json: "▁" before the text, always (SentencePiece's dummy prefix, which Gemma's
    # vocabulary goes without: llama.cpp records add_space_prefix), and for spaces.
    prefix = not ("tokenizer.ggml.add_space_prefix" in meta and not meta["tokenizer.ggml.add_space_prefix"])
    spaces = normalizers.Replace(" ", "▁")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", int(prefix), 0)]
    )
    add_bos = bool(meta["tokenizer.ggml.add_bos_token"]) if "tokenizer.ggml.add_bos_token" in meta else True
    if add_bos and "tokenizer.ggml.bos_token_id" in meta:  # SentencePiece models start every text with BOS
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    # Control (3) and user-defined (4) tokens are special, as for byte-level vocabularies; so is the unknown one.
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, kind in enumerate(kinds) if kind in (2, 3, 4)]
    )
    return tokenizer.to_str()


def _remove_aside(folder: Path, why: str) -> None:
    """Delete ``folder`` once renamed aside (a hidden name of this process's), so that no reader ever finds it half
    deleted; raises OSError where it cannot be renamed."""
    aside = folder.with_name(f".{folder.name}.{why}.{os.getpid()}")
    os.rename(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _publish(staging: Path, out: Path) -> None:
    """Move a finished conversion into place; when another process (or host, on a shared cache) got there first
    with a whole folder, use theirs. A folder whose conversion died half-way is never at ``out``: each process
    converts into a folder of its own and renames it whole."""
    try:
        os.rename(staging, out)
        return
    except OSError as e:
        if not out.is_dir():
            raise
        if (out / "config.json").is_file():
            log.info("gguf converted meanwhile by another process; using its folder", folder=str(out), error=e.strerror)
            shutil.rmtree(staging, ignore_errors=True)
            return
    # Not ours and not whole (a converter before atomic renames, or a copy cut short): set it aside, then retry.
    _remove_aside(out, "broken")
    try:
        os.rename(staging, out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(staging, ignore_errors=True)


# What dequantizing added to the model, as a share of the file, past which it is worth a warning.
_GREW = 0.5


def _reader(gguf: Path) -> GGUFReader:
    """llama.cpp's own reader over the file, mapped: a tensor's blocks are read when converted."""
    from gguf import GGUFReader

    try:
        return GGUFReader(gguf)
    except ValueError as e:  # its magic, version or a tensor's extent
        raise GGUFError(f"{gguf.name} is not a GGUF file gguf-py can read: {e}") from None


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """The file's key-value metadata: strings, numbers, booleans, and lists of them."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def converted(gguf: Path) -> Path:
    """The MLX folder converted from ``gguf``, made on first use and kept under the cache directory."""
    # fp32 on Linux CPU: it is the only dtype that goes through BLAS there.
    linux_cpu = cpu.is_linux_cpu_backend()
    dtype = "float32" if linux_cpu else "float16"
    # Quantized blocks stay quantized where their products are fast: MLX's own on an accelerator, neuron's kernel
    # on a Linux CPU. Where the kernel cannot be built, MLX's CPU product is slower than fp32 BLAS: dequantized.
    tools = quantized_toolchain() if linux_cpu else None
    why = tools if isinstance(tools, str) else ""
    quantized = not why
    stat = gguf.stat()
    layout = "quantized" if quantized else "dequantized"
    key = hashlib.sha256(
        f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|mlx.core.{dtype}|{layout}|{CONVERTER_VERSION}".encode()
    )
    out = cache_dir() / "models" / f"{gguf.stem}-{key.hexdigest()[:12]}"
    if not (out / "config.json").is_file():
        prune_stale(out.parent)
        if why:
            log.warning("gguf dequantized", source=str(gguf), why=why, fix=QUANTIZED_FIX)
        try:
            convert(gguf, out, dtype, quantized)
        except KeyError as e:
            raise GGUFError(f"{gguf.name} lacks the metadata {e} its conversion needs: is it a whole GGUF file?") from e
    return out


def prune_stale(models: Path) -> list[Path]:
    """Delete the folders converted into ``models`` that nothing will read again: an older converter made them (its
    folders are keyed apart), or this host made them and their GGUF file is gone (a venv or a clone deleted, a file
    renamed). Called before each new conversion, so that the cache holds one folder per file and layout in use, not
    every one ever made. A folder another host converted into a shared cache names a file of that host's, and is
    left to it; so is a folder without a ``source.json``, which is not this converter's. Returns what it deleted."""
    pruned = []
    for folder in sorted(models.glob("*/source.json")):
        try:
            source = json.loads(folder.read_text())
            older = int(source["converter"]) < CONVERTER_VERSION
            gone = source.get("host") == socket.gethostname() and not Path(source["gguf"]).is_file()
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # being written, or not ours to judge
        if older or gone:
            try:
                _remove_aside(folder.parent, "stale")
            except OSError:
                continue  # another process pruned it first
            pruned.append(folder.parent)
    if pruned:
        log.info("gguf cache pruned", folders=[str(p) for p in pruned])
    return pruned


def convert(gguf: Path, out: Path, dtype_name: str, quantized: bool = True) -> None:
    """Write an MLX model folder for ``gguf`` at ``out``, its quantized blocks kept quantized where ``quantized``
    and the other weights in ``dtype_name`` (atomically: a crash leaves no half folder)."""
    import mlx.core as mx  # here, not at the top: ``converted`` finds a folder already made without MLX

    started = time.perf_counter()
    dtype = getattr(mx, dtype_name)
    reader = _reader(gguf)
    meta = metadata(reader)
    name = str(meta.get("general.architecture"))
    if name not in ARCHS:
        raise GGUFError(
            f"{gguf.name}: neuron converts GGUF files of the {', '.join(ARCHS)} architectures, not {name!r}; "
            "convert it with mlx_lm.convert and pass the folder"
        )
    arch = ARCHS[name]

    def number(key: str, default: float | None = None) -> Any:
        if f"{name}.{key}" not in meta:
            if default is None:
                raise GGUFError(f"{gguf.name} lacks the metadata {name}.{key} a {name} model needs")
            return default
        return meta[f"{name}.{key}"]

    heads = int(number("attention.head_count"))
    kv_heads = int(number("attention.head_count_kv", heads))
    hidden = int(number("embedding_length"))
    tokens = meta["tokenizer.ggml.tokens"]
    config = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_class],
        "hidden_size": hidden,
        "intermediate_size": int(number("feed_forward_length")),
        "num_hidden_layers": int(number("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(number("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(number("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(number("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(number("context_length")),
        "vocab_size": len(tokens),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]) if "tokenizer.ggml.bos_token_id" in meta else None,
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "torch_dtype": dtype_name,
    }
    special = {
        k: tokens[int(meta[f"tokenizer.ggml.{k}_token_id"])]
        for k in ("bos", "eos", "unknown", "padding")
        if f"tokenizer.ggml.{k}_token_id" in meta
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special.get("bos"),
        "eos_token": special.get("eos"),
        "unk_token": special.get("unknown"),
        "pad_token": special.get("padding"),
        "add_bos_token": bool(meta["tokenizer.ggml.add_bos_token"])
        if "tokenizer.ggml.add_bos_token" in meta
        else False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        try:
            done = _weights(reader.tensors, arch, heads, kv_heads, dtype, quantized)
        except GGUFError as e:  # a tensor's: say whose file
            raise GGUFError(f"{gguf.name}: {e}") from None
        layouts = list(done.layouts.values())
        if layouts:  # as mlx-lm reads it: the most common layout, and each module that differs by name
            common = max(layouts, key=layouts.count)
            config["quantization"] = {**common, **{name: lay for name, lay in done.layouts.items() if lay != common}}
        mx.save_safetensors(str(staging / "model.safetensors"), done.weights, metadata={"format": "mlx"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "tokenizer.json").write_text(_tokenizer_json(meta))
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        source = {"gguf": str(gguf), "host": socket.gethostname(), "converter": CONVERTER_VERSION}
        (staging / "source.json").write_text(json.dumps(source))
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    size = sum(a.nbytes for a in done.weights.values())
    dequantized = Tally()
    for tally in done.dequantized.values():
        dequantized.tensors += tally.tensors
        dequantized.file_bytes += tally.file_bytes
        dequantized.bytes += tally.bytes
    log.info(
        "gguf converted",
        source=str(gguf),
        folder=str(out),
        dtype=config["torch_dtype"],
        quantized=len(done.layouts),  # tensors kept in their quantized blocks, in MLX's layout
        quantized_formats=_tallied(done.kept),
        dequantized=dequantized.tensors,  # tensors of a block format converted to dtype
        dequantized_formats=_tallied(done.dequantized),
        dequantized_file_bytes=dequantized.file_bytes,
        dequantized_bytes=dequantized.bytes,
        file_bytes=file_bytes,
        bytes=size,
        ms=ms_since(started),
    )
    # Without the kernel, ``converted`` has warned already: everything is dequantized, and how to get it said.
    if quantized and dequantized.bytes - dequantized.file_bytes >= _GREW * file_bytes:
        log.warning(
            "gguf grew by dequantizing",
            source=str(gguf),
            dequantized_formats=_tallied(done.dequantized),
            file_bytes=file_bytes,
            bytes=size,
            grew=round(size / file_bytes, 1),
            why="MLX's quantized layout holds none of these formats' blocks exactly",
            fix="a Q8_0, Q5_0, Q5_1, Q4_0 or Q4_1 file stays quantized whole (a K-quant one mixes in Q6_K)",
        )
