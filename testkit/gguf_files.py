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
    ``quant`` (Q4_0, Q4_1, Q8_0), every matrix whose rows are whole blocks of 32 in that block format, as
    llama.cpp's quantizer writes them (``gguf.quants``)."""
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
        if quant is not None and tensor.ndim == 2 and tensor.shape[1] % 32 == 0:
            kind = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(tensor, kind), raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_name(name), tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


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
