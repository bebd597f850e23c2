"""GGUF files written from a tiny model folder with the ``gguf`` package, as llama.cpp's converter writes them:
GGUF tensor names, q/k rows permuted for llama's rope layout, the tokenizer and chat template in the metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


# Q4_K_M as llama.cpp mixes it, simplified: Q6_K for the value and down projections (llama.cpp: half of them, and
# the output matrix), Q4_K for every other matrix.
MIXES = {"Q4_K_M": {"attn_v": "Q6_K", "ffn_down": "Q6_K"}}
# What llama.cpp's quantizer writes instead of a K-quant where a matrix's rows are not whole super-blocks of 256
# (SmolLM2's 576 columns): most of a real Q4_K_M file of such a model is Q5_0.
_NOT_WHOLE = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _gguf_name(name: str) -> str:
    base, _, leaf = name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{leaf}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{leaf}"


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaving of each head's rotary halves (what neuron's converter undoes)."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(
    folder: Path,
    out: Path,
    arch: str,
    pre: str = "default",
    sentencepiece: Path | None = None,
    quant: str | None = None,
) -> Path:
    """``folder``'s model as a float32 GGUF file of architecture ``arch`` (llama, qwen2, qwen3, gemma); its tokenizer,
    or the SentencePiece model ``sentencepiece`` as llama.cpp writes one (``llama``: pieces, scores, types). With
    ``quant``, every matrix whose rows are whole blocks in that GGML type: a block format gguf-py writes (Q4_0,
    Q4_1, Q8_0, Q5_0, Q5_1: as llama.cpp's quantizer does), Q4_K, Q5_K or Q6_K (``_k_quant``; where rows are not
    whole super-blocks, what llama.cpp writes instead: ``_NOT_WHOLE``), a mix (``MIXES``: Q4_K_M), or an integer
    type (I8: the values cast, a tensor no model holds)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(folder.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    if sentencepiece is not None:
        _sentencepiece_tokens(writer, sentencepiece)
    else:
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        specials = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
        tokens = sorted(vocab, key=vocab.__getitem__)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in specials else 1 for t in tokens])
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])
    for name, tensor in sorted(load_file(str(folder / "model.safetensors")).items()):
        tensor = tensor.astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            tensor = _permute(tensor, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            tensor = _permute(tensor, kv_heads)
        elif arch == "gemma" and name.endswith("norm.weight"):
            tensor = tensor + 1.0  # llama.cpp stores Gemma's norms as the scale they apply, 1 + w
        kind = _kind(name, quant)
        if kind is not None and kind.name in _NOT_WHOLE and tensor.ndim == 2 and tensor.shape[1] % 256:
            kind = gguf.GGMLQuantizationType[_NOT_WHOLE[kind.name]]
        if kind is not None and tensor.ndim == 2 and tensor.shape[1] % gguf.GGML_QUANT_SIZES[kind][0] == 0:
            if kind.name == "I8":
                writer.add_tensor(_gguf_name(name), tensor.astype(np.int8))
            elif kind.name in ("Q4_K", "Q5_K", "Q6_K"):
                writer.add_tensor(_gguf_name(name), _k_quant(tensor, kind.name), raw_dtype=kind)
            else:
                writer.add_tensor(_gguf_name(name), gguf.quants.quantize(tensor, kind), raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_name(name), tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _kind(name: str, quant: str | None) -> Any:
    """The GGML type ``quant`` writes the tensor ``name`` in (a mix's own for its tensors), None for float32."""
    import gguf

    if quant is None:
        return None
    mix = MIXES.get(quant, {})
    role = _gguf_name(name).split(".")[-2]
    return gguf.GGMLQuantizationType[mix.get(role, quant.removesuffix("_M"))]


def _sentencepiece_tokens(writer: Any, model: Path) -> None:
    """A SentencePiece model's vocabulary as llama.cpp's converter writes it: token types 1 normal, 2 unknown,
    3 control, 6 byte; BOS added to every text."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    pieces = range(sp.get_piece_size())
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in pieces]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in pieces])
    writer.add_token_scores([sp.get_score(i) for i in pieces])
    writer.add_token_types(kinds)
    writer.add_unk_token_id(sp.unk_id())
    writer.add_bos_token_id(sp.bos_id())
    writer.add_add_bos_token(True)


def train_sentencepiece(folder: Path, vocab: int = 330) -> Path:
    """A tiny SentencePiece BPE model with byte fallback, as Llama 2's and Mistral's are made."""
    import sentencepiece

    lines = [
        "The quick brown fox jumps over the lazy dog.",
        "The hub serves models by name, from the cache every tool shares.",
        "Tensor parallel inference splits heads over ranks; pipeline stages split layers.",
        "12345 67890 hello world",
    ] * 50
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text("\n".join(lines))
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"),
        model_prefix=str(folder / "spm"),
        vocab_size=vocab,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        # As Llama 2's and Mistral's: no normalization, spaces kept as written (llama.cpp tokenizes so too).
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    return folder / "spm.model"


def _k_quant(tensor: np.ndarray, kind: str) -> np.ndarray:
    """``tensor`` (rows of whole super-blocks of 256) as Q4_K, Q5_K or Q6_K blocks, which gguf-py reads but does not
    write: a valid encoding (each sub-block's range, its scales rounded to 6 or 8 bits against the super-block's),
    not llama.cpp's search for the best one."""
    blocks = tensor.reshape(-1, 256).astype(np.float32)
    encode = {"Q4_K": _q4_k_blocks, "Q5_K": _q5_k_blocks, "Q6_K": _q6_k_blocks}[kind]
    return encode(blocks).reshape(tensor.shape[0], -1)


def _ratio(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.divide(x, scale, out=np.zeros(np.broadcast_shapes(x.shape, scale.shape), np.float32), where=scale != 0)


def _k_affine(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's common part: each 32-value sub-block's values q in 0..``top``, and the super-block's first
    16 bytes: d, dmin (float16), then eight 6-bit (scale, min) pairs packed in 12 bytes; value = d * sc * q - dmin * m.
    """
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)
    scale, floor = (sub.max(axis=-1) - low) / top, -low
    d = (scale.max(axis=-1) / 63).astype(np.float16)
    dmin = (floor.max(axis=-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(_ratio(scale, d[:, None].astype(np.float32))), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_ratio(floor, dmin[:, None].astype(np.float32))), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.rint(_ratio(sub + offset, step)), 0, top).astype(np.uint8)
    packed = np.concatenate(
        [
            (sc[:, :4] & 63) | (sc[:, 4:] >> 4 << 6),
            (m[:, :4] & 63) | (m[:, 4:] >> 4 << 6),
            (sc[:, 4:] & 0xF) | (m[:, 4:] << 4),
        ],
        axis=-1,
    )
    return q, np.concatenate([_bytes(d), _bytes(dmin), packed], axis=-1)


def _k_nibbles(q: np.ndarray) -> np.ndarray:
    """Eight sub-blocks' low nibbles in four runs of 32 bytes, sub-block 2r in the low nibbles and 2r + 1 in the
    high ones."""
    runs = (q & 0xF).reshape(-1, 4, 2, 32)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k_blocks(x: np.ndarray) -> np.ndarray:
    """144 bytes a super-block: ``_k_affine``'s 16, then the nibbles."""
    q, head = _k_affine(x, 15)
    return np.concatenate([head, _k_nibbles(q)], axis=-1)


def _q5_k_blocks(x: np.ndarray) -> np.ndarray:
    """176 bytes a super-block: ``_k_affine``'s 16, 32 bytes of fifth bits (sub-block i's value l at bit i of byte
    l, unlike Q5_0's bit l of a block's 32-bit word), then Q4_K's nibbles."""
    q, head = _k_affine(x, 31)
    qh = np.packbits((q >> 4).swapaxes(-1, -2), axis=-1, bitorder="little").reshape(-1, 32)
    return np.concatenate([head, qh, _k_nibbles(q)], axis=-1)


def _q6_k_blocks(x: np.ndarray) -> np.ndarray:
    """210 bytes a super-block: 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 scales (one per 16
    values), d (float16); value = d * scale * (q - 32). In each half of 128 values, value 64s + l's low nibble is
    in byte l's nibble s, and value 32k + l's high pair at bits 2k of byte l."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = (scale.max(axis=-1) / 127).astype(np.float16)
    sc = np.clip(np.rint(_ratio(scale, d[:, None].astype(np.float32))), 0, 127).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = (np.clip(np.rint(_ratio(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    nibbles = (q & 0xF).reshape(-1, 2, 2, 64)
    pairs = (q >> 4).reshape(-1, 2, 4, 32)
    ql = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(-1, 128)
    qh = (pairs[:, :, 0] | (pairs[:, :, 1] << 2) | (pairs[:, :, 2] << 4) | (pairs[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _bytes(d)], axis=-1)


def _bytes(halves: np.ndarray) -> np.ndarray:
    return halves.astype("<f2").reshape(-1, 1).view(np.uint8)
