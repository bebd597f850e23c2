"""Tiny random-weight vision-language models with a real processor, for the tests and the benchmarks.

Made with mlx-vlm's own classes (its vision tower, projector and language model), saved under the names mlx-vlm
and mlx-lm both load, with a byte-level tokenizer that knows the image tokens and a chat template that renders
image parts: the folder is a model either library serves, no download.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from testkit.models import SPECIALS

# Mistral 3's image markers (its processor's defaults): one [IMG] per merged patch, [IMG_BREAK] after each row,
# [IMG_END] after the last.
IMAGE_SPECIALS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]

# Mistral's shape of a chat, rendering an image part (OpenAI's, or mlx-vlm's {"type": "image"}) as [IMG].
MISTRAL3_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST]{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% elif p['type'] in ('image', 'image_url') %}[IMG]{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if m['role'] == 'user' %}[/INST]{% else %}<|im_end|>{% endif %}"
    "{% endfor %}"
)


def _tokenizer(folder: Path, template: str) -> dict[str, int]:
    """Printable ASCII, space and newline, a token each (no merges), the text model's specials and the image
    markers; returns the vocabulary. Every token is a whole character, so a reply's text and its logprobs'
    tokens name the token ids exactly (a lone byte of a longer character would decode to U+FFFD)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = SPECIALS + IMAGE_SPECIALS
    ascii_ = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # byte-level's space and newline
    vocab = {tok: i for i, tok in enumerate(specials + ascii_)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "bos_token": None,
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return vocab


def make_tiny_mistral3(
    folder: Path,
    seed: int = 0,
    longest_edge: int = 64,
    hidden: int = 256,
    layers: int = 2,
    patch: int = 8,
    vision_hidden: int = 64,
    vision_layers: int = 2,
) -> Path:
    """A Mistral 3 (Pixtral vision tower, patch merger, llama-shaped language model) of random weights.

    Patches of ``patch`` pixels merged 2 by 2: at the defaults an image of ``longest_edge`` pixels a side becomes
    (edge/16)² image tokens (16), plus a break per row.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_vlm.utils import get_model_and_args

    folder.mkdir(parents=True)
    vocab = _tokenizer(folder, MISTRAL3_TEMPLATE)
    config = {
        "model_type": "mistral3",
        "image_token_index": vocab["[IMG]"],
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "eos_token_id": vocab["<|im_end|>"],
        "text_config": {
            "model_type": "mistral",
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "intermediate_size": hidden * 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "rms_norm_eps": 1e-5,
            "vocab_size": len(vocab),
            "max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "pixtral",
            "hidden_size": vision_hidden,
            "num_hidden_layers": vision_layers,
            "intermediate_size": vision_hidden * 2,
            "num_attention_heads": 2,
            "head_dim": vision_hidden // 2,
            "image_size": longest_edge,
            "patch_size": patch,
            "num_channels": 3,
            "rope_theta": 10000.0,
        },
    }
    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config.text_config = module.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    # As testkit.models does: larger matrices make greedy decoding wander, so a comparison means something.
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "PixtralImageProcessor",
                "size": {"longest_edge": longest_edge},
                "patch_size": {"height": patch, "width": patch},
                "do_resize": True,
                "do_rescale": True,
                "do_normalize": True,
                "do_convert_rgb": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "rescale_factor": 1 / 255,
            }
        )
    )
    (folder / "processor_config.json").write_text(
        json.dumps({"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"})
    )
    return folder


def png(width: int = 64, height: int = 64, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A picture of noise (each seed its own), encoded in ``fmt``."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()
