"""Tiny random-weight models of every architecture neuron's table names: one config each, built from mlx-lm's
own ``ModelArgs``, with windows short enough that the tests' prompts run past them.

Every model has 4 attention heads and 2 key/value heads (and 4 value / 2 key heads of linear attention), so
each splits over 2 ranks where a split plan exists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testkit import GLM4_MOE

WINDOW = 8  # sliding windows shorter than the tests' prompts: the rotating caches wrap
TWO_KINDS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

_BASE: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}
_LINEAR = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}

# Each architecture's own fields, over _BASE. "windowed_mistral" is mistral with alternating sliding layers.
EXTRA: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {"tie_word_embeddings": True},
    "windowed_mistral": {"model_type": "mistral", "sliding_window": WINDOW, "layer_types": TWO_KINDS},
    "qwen3_moe": {**_MOE, "num_experts": 4, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "deepseek_v3": {
        **_MOE,
        "kv_lora_rank": 32,
        "q_lora_rank": 64,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "glm4_moe": {**_MOE, **GLM4_MOE},
    "phi3": {},
    "granite": {
        "logits_scaling": 2.0,
        "attention_multiplier": 0.1,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "olmo2": {},
    "qwen3_next": {
        **_LINEAR,
        **_MOE,
        "num_experts": 4,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "partial_rotary_factor": 0.25,
    },
    "qwen3_5": {**_LINEAR},  # nested under text_config by _config
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW, "layer_types": TWO_KINDS},
    "gemma3_text": {"sliding_window": WINDOW, "sliding_window_pattern": 2, "query_pre_attn_scalar": 32},
    "gemma4_text": {
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "layer_types": TWO_KINDS,
        "global_head_dim": 32,
        "num_kv_shared_layers": 1,  # its last layer reads the keys and values of layer 1 (so a stage holds both)
        "hidden_size_per_layer_input": 16,
        "use_double_wide_mlp": False,
        "final_logit_softcapping": 30.0,
        "num_global_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
}
ARCHS = list(EXTRA)
# How much the random matrices are grown; gemma4's soft-capped logits saturate (one token forever) unless smaller.
SCALE = {"gemma4_text": 0.5}


def config(arch: str, vocab: int) -> dict[str, Any]:
    fields = {"model_type": arch, **_BASE, "vocab_size": vocab, **EXTRA[arch]}
    if arch == "qwen3_5":  # the text model's fields nest, as in Qwen3.5/3.6's own config
        text = {**fields, "model_type": "qwen3_5_text"}
        text.pop("eos_token_id")
        return {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False, "eos_token_id": 2}
    if arch == "gemma4_text":
        fields["vocab_size_per_layer_input"] = vocab
    return fields


def make_arch_model(folder: Path, arch: str, seed: int = 0) -> Path:
    """A random-weight ``arch`` model with the tests' tokenizer in ``folder``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes

    from testkit.models import tokenizer_files

    folder.mkdir(parents=True)
    cfg = config(arch, -(-tokenizer_files(folder) // 4) * 4)  # qwen3_5's shard() splits the vocabulary evenly
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(cfg))
    # As make_tiny_model: larger matrices make greedy decoding wander, so a comparison means something.
    scale = SCALE.get(arch, 4.0)
    model.update(tree_map(lambda p: p * scale if p.ndim >= 2 else p, model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder
