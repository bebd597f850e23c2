"""Convert a GGUF file (llama and Mistral, Qwen2, Qwen3, Gemma) into an MLX model folder, once.

``mx.load`` reads GGUF natively, quantized blocks included, so no llama.cpp
code is needed: this module keeps the blocks MLX reads as its own quantized
layout (and dequantizes the others), renames tensors to the Hugging Face
names mlx-lm expects, undoes what llama.cpp's converter changed (the rotary
permutation of llama's q/k rows, the 1 it adds to Gemma's norms), and rebuilds
the tokenizer and chat template from the metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import structlog

from neuron.log import ms_since
from neuron.models.progress import Meter
from neuron.system import cpu
from neuron.system.native import QUANTIZED_FIX, quantized_toolchain
from neuron.system.paths import cache_dir

if TYPE_CHECKING:
    import mlx.core as mx

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
CONVERTER_VERSION = 3


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

# GGUF quantizes in blocks of 32 values (Q4_0, Q4_1, Q8_0), which MLX reads as groups of 32.
_GGUF_GROUP = 32


class GGUFError(ValueError):
    pass


def _scalar(meta: dict[str, Any], key: str) -> Any:
    import mlx.core as mx

    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def _hf_name(name: str) -> str:
    base, _, leaf = name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{leaf}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{leaf}"
    raise GGUFError(f"unexpected tensor {name!r} in the GGUF file: neuron does not know where it goes")


def _unpermute(weight: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's per-head interleaving of the rotary halves of q/k rows."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _weights(
    arrays: dict[str, mx.array], arch: Arch, heads: int, kv_heads: int, dtype: mx.Dtype, quantized: bool
) -> tuple[dict[str, mx.array], dict[str, dict[str, int]]]:
    """The tensors under mlx-lm's names, the others in ``dtype``; a quantized block format that MLX reads as its
    affine layout (Q4_0, Q4_1, Q8_0: exactly) kept so where ``quantized``, else dequantized. Returns the tensors,
    and each module kept quantized with its bits, as a config's ``quantization`` names them."""
    import mlx.core as mx

    out, layouts = {}, {}
    names = [n for n in arrays if not n.endswith((".scales", ".biases"))]
    with Meter("converting", sum(a.nbytes for a in arrays.values())) as meter:
        for name in names:
            base = name.removesuffix(".weight")
            parts = {"weight": arrays[name]}
            if f"{base}.scales" in arrays:
                scales, biases = arrays[f"{base}.scales"], arrays.get(f"{base}.biases")
                bits = parts["weight"].shape[-1] // scales.shape[-1]
                if quantized and biases is not None:
                    parts |= {"scales": scales, "biases": biases}
                    layouts[_hf_name(name).removesuffix(".weight")] = {"group_size": _GGUF_GROUP, "bits": bits}
                else:  # in float32, as the kernel dequantizes: float16 scales would round every weight to float16
                    parts["weight"] = mx.dequantize(
                        parts["weight"],
                        scales.astype(mx.float32),
                        None if biases is None else biases.astype(mx.float32),
                        group_size=_GGUF_GROUP,
                        bits=bits,
                    )
            if "scales" not in parts:
                parts["weight"] = parts["weight"].astype(dtype)
            for leaf, array in parts.items():  # a row's scales and biases move with its words
                if arch.permuted and base.endswith(".attn_q"):
                    array = _unpermute(array, heads)
                elif arch.permuted and base.endswith(".attn_k"):
                    array = _unpermute(array, kv_heads)
                elif arch.norm_offset and base.endswith("norm"):
                    array = array - arch.norm_offset
                mx.eval(array)
                out[_hf_name(name if leaf == "weight" else f"{base}.{leaf}")] = array  # a bias is named as it is
            meter.advance(sum(arrays[k].nbytes for k in (name, f"{base}.scales", f"{base}.biases") if k in arrays))
    return out, layouts


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
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
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
    kinds = meta["tokenizer.ggml.token_type"].tolist()
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

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    scores = meta["tokenizer.ggml.scores"].tolist()
    kinds = meta["tokenizer.ggml.token_type"].tolist()
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
    unknown = int(_scalar(meta, "tokenizer.ggml.unknown_token_id")) if "tokenizer.ggml.unknown_token_id" in meta else 0
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
    prefix = not ("tokenizer.ggml.add_space_prefix" in meta and not _scalar(meta, "tokenizer.ggml.add_space_prefix"))
    spaces = normalizers.Replace(" ", "▁")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", int(prefix), 0)]
    )
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token")) if "tokenizer.ggml.add_bos_token" in meta else True
    if add_bos and "tokenizer.ggml.bos_token_id" in meta:  # SentencePiece models start every text with BOS
        bos_id = int(_scalar(meta, "tokenizer.ggml.bos_token_id"))
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    # Control (3) and user-defined (4) tokens are special, as for byte-level vocabularies; so is the unknown one.
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, kind in enumerate(kinds) if kind in (2, 3, 4)]
    )
    return tokenizer.to_str()


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
    aside = out.with_name(f".{out.name}.broken.{os.getpid()}")
    os.rename(out, aside)
    shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(staging, out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(staging, ignore_errors=True)


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
        if why:
            log.warning("gguf dequantized", source=str(gguf), why=why, fix=QUANTIZED_FIX)
        try:
            convert(gguf, out, dtype, quantized)
        except KeyError as e:
            raise GGUFError(f"{gguf.name} lacks the metadata {e} its conversion needs: is it a whole GGUF file?") from e
    return out


def convert(gguf: Path, out: Path, dtype_name: str, quantized: bool = True) -> None:
    """Write an MLX model folder for ``gguf`` at ``out``, its quantized blocks kept quantized where ``quantized``
    and the other weights in ``dtype_name`` (atomically: a crash leaves no half folder)."""
    import mlx.core as mx  # here, not at the top: ``converted`` finds a folder already made without MLX

    started = time.perf_counter()
    dtype = getattr(mx, dtype_name)
    # With its metadata, ``mx.load`` returns a pair: the arrays by name, and the metadata. The format is named:
    # a file of the Hugging Face cache is a blob with no extension to infer it from.
    try:
        loaded = mx.load(str(gguf), format="gguf", return_metadata=True)
    except RuntimeError as e:  # a block format MLX's reader neither holds nor converts (Q5_0, say)
        raise GGUFError(
            f"{gguf.name}: MLX's GGUF reader cannot read its tensors ({e}); it reads F32, F16, Q4_0, Q4_1 and Q8_0: "
            "pass the model in one of those, or convert the original with mlx_lm.convert and pass the folder"
        ) from None
    arrays, meta = cast("tuple[dict[str, mx.array], dict[str, Any]]", loaded)
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
        return _scalar(meta, f"{name}.{key}")

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
        "tie_word_embeddings": "output.weight" not in arrays,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id"))
        if "tokenizer.ggml.bos_token_id" in meta
        else None,
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": dtype_name,
    }
    special = {
        k: tokens[int(_scalar(meta, f"tokenizer.ggml.{k}_token_id"))]
        for k in ("bos", "eos", "unknown", "padding")
        if f"tokenizer.ggml.{k}_token_id" in meta
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special.get("bos"),
        "eos_token": special.get("eos"),
        "unk_token": special.get("unknown"),
        "pad_token": special.get("padding"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token"))
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
        weights, layouts = _weights(arrays, arch, heads, kv_heads, dtype, quantized)
        if layouts:  # as mlx-lm reads it: the most common layout, and each module that differs by name
            common = max(layouts.values(), key=list(layouts.values()).count)
            config["quantization"] = {**common, **{name: lay for name, lay in layouts.items() if lay != common}}
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "tokenizer.json").write_text(_tokenizer_json(meta))
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        (staging / "source.json").write_text(json.dumps({"gguf": str(gguf), "converter": CONVERTER_VERSION}))
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info(
        "gguf converted",
        source=str(gguf),
        folder=str(out),
        dtype=config["torch_dtype"],
        quantized=len(layouts),  # tensors kept in their quantized blocks; the others in dtype
        ms=ms_since(started),
    )
