"""Tiny random-weight vision-language models with a real processor, for the tests and the benchmarks.

Made with mlx-vlm's own classes (its vision tower, projector and language model), saved under the names mlx-vlm
and mlx-lm both load, with a byte-level tokenizer that knows the image tokens and a chat template that renders
image parts: the folder is a model either library serves, no download.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx

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


# Gemma 3's and Gemma 4's: the chat template writes the begin-of-image marker, which the processor expands into it,
# the image's soft tokens (their features' places) and the end-of-image marker.
GEMMA_SPECIALS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% elif p['type'] in ('image', 'image_url') %}<start_of_image>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(
    folder: Path, template: str, image_specials: list[str] = IMAGE_SPECIALS, **extra: object
) -> dict[str, int]:
    """Printable ASCII, space and newline, a token each (no merges), the text model's specials and the image
    markers; returns the vocabulary. Every token is a whole character, so a reply's text and its logprobs'
    tokens name the token ids exactly (a lone byte of a longer character would decode to U+FFFD). ``extra``:
    more of tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = SPECIALS + image_specials
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
        **extra,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return vocab


def _language_shape(hidden: int, layers: int, vocab: int) -> dict[str, int]:
    """A tiny language model's shape: 4 query heads of 64 over 2 key/value heads, so that TP=2 splits them."""
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
    }


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
            **_language_shape(hidden, layers, len(vocab)),
            "rms_norm_eps": 1e-5,
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
    _save(folder, config, seed)
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


def _save(
    folder: Path, config: dict, seed: int, scale: float = 4.0, embed_scale: float | None = None, tied: bool = False
) -> None:
    """mlx-vlm's model of ``config``, random, saved with its config; its matrices scaled by ``scale``, its token
    embedding by ``embed_scale`` where given; ``tied``: no head saved (the embedding is the head)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_vlm.utils import get_model_and_args

    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config.text_config = module.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    # As testkit.models does: larger matrices make greedy decoding wander, so a comparison means something.
    model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    if embed_scale is not None:
        embed = model.language_model.model.embed_tokens
        embed.weight = embed.weight * (embed_scale / scale)
    projector = model.get("multi_modal_projector")
    if projector is not None and "mm_input_projection_weight" in projector:
        # Gemma 3's projection starts as ones: over the vision tower's layer-normed (zero-mean) features, every
        # image would project to zeros.
        weight = projector.mm_input_projection_weight
        projector.mm_input_projection_weight = mx.random.normal(weight.shape) * scale / 8
    weights = dict(tree_flatten(model.parameters()))
    if tied:
        weights.pop("language_model.lm_head.weight", None)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))


EMBED_SCALE = 0.25


def make_tiny_gemma3(
    folder: Path, seed: int = 0, hidden: int = 256, layers: int = 4, window: int = 24, image_size: int = 32
) -> Path:
    """A Gemma 3 (SigLIP vision tower, pooled projector, Gemma 3 language model with sliding-window layers
    alternating with global ones) of random weights. An image is 4 soft tokens between its begin and end markers,
    and the window is short enough that a chat with an image passes it."""
    folder.mkdir(parents=True)
    markers = dict(zip(("boi_token", "eoi_token", "image_token"), GEMMA_SPECIALS, strict=True))
    vocab = _tokenizer(folder, GEMMA_TEMPLATE, GEMMA_SPECIALS, extra_special_tokens=markers)
    config = {
        "model_type": "gemma3",
        "image_token_index": vocab["<image_soft_token>"],
        "boi_token_index": vocab["<start_of_image>"],
        "eoi_token_index": vocab["<end_of_image>"],
        "mm_tokens_per_image": 4,
        "eos_token_id": vocab["<|im_end|>"],
        "vocab_size": len(vocab),
        "hidden_size": hidden,
        "text_config": {
            "model_type": "gemma3_text",
            **_language_shape(hidden, layers, len(vocab)),
            "query_pre_attn_scalar": 64,
            "rms_norm_eps": 1e-6,
            "sliding_window": window,
            "sliding_window_pattern": 2,
            "mm_tokens_per_image": 4,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "patch_size": 8,
            "image_size": image_size,
            "layer_norm_eps": 1e-6,
        },
    }
    # A smaller token embedding than the other matrices: Gemma scales it up by the square root of the hidden size,
    # and at the others' scale it outweighs the layers, so that greedy decoding repeats one token. Tied, as Gemma's
    # checkpoints are (mlx-vlm's gemma3 ties them whatever the checkpoint holds).
    _save(folder, config, seed, embed_scale=EMBED_SCALE, tied=True)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Gemma3ImageProcessor",
                "size": {"height": image_size, "width": image_size},
                "do_resize": True,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "do_convert_rgb": True,
                "do_pan_and_scan": False,
                "resample": 2,
            }
        )
    )
    (folder / "processor_config.json").write_text(
        json.dumps({"image_seq_length": 4, "processor_class": "Gemma3Processor"})
    )
    return folder


def make_tiny_gemma4(folder: Path, seed: int = 0, hidden: int = 256, layers: int = 4, window: int = 24) -> Path:
    """A Gemma 4 (its vision tower and projector, a Gemma 4 language model with per-layer inputs, sliding-window
    layers alternating with global ones, its last layer reading an earlier one's keys and values) of random
    weights. An image is 4 soft tokens between its begin and end markers; its chat template writes the image
    token, which the processor expands."""
    folder.mkdir(parents=True)
    markers = dict(zip(("boi_token", "eoi_token", "image_token"), GEMMA_SPECIALS, strict=True))
    template = GEMMA_TEMPLATE.replace("<start_of_image>", "<image_soft_token>")
    vocab = _tokenizer(folder, template, GEMMA_SPECIALS, extra_special_tokens=markers)
    kinds = ["sliding_attention", "full_attention"] * (layers // 2)
    config = {
        "model_type": "gemma4",
        "image_token_id": vocab["<image_soft_token>"],
        "boi_token_id": vocab["<start_of_image>"],
        "eoi_token_id": vocab["<end_of_image>"],
        "eos_token_id": vocab["<|im_end|>"],
        "vocab_size": len(vocab),
        "hidden_size": hidden,
        "vision_soft_tokens_per_image": 4,
        "text_config": {
            "model_type": "gemma4_text",
            **_language_shape(hidden, layers, len(vocab)),
            "global_head_dim": 64,
            "num_global_key_value_heads": 2,
            "num_kv_shared_layers": 1,
            "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": len(vocab),
            "use_double_wide_mlp": False,
            "final_logit_softcapping": 30.0,
            "sliding_window": window,
            "sliding_window_pattern": 2,
            "layer_types": kinds,
            # Said out loud, as Gemma 4's configs say it: mlx-vlm's and mlx-lm's defaults differ.
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 1e4, "rope_type": "default"},
            },
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
        },
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "global_head_dim": 32,
            "patch_size": 8,
            "pooling_kernel_size": 2,
            "position_embedding_size": 64,
            "default_output_length": 4,
        },
    }
    _save(folder, config, seed, scale=0.5, tied=True)
    # Normalized to [-1, 1]: the tower's patches then differ from picture to picture, and so does the output.
    image = {"patch_size": 8, "max_soft_tokens": 9, "pooling_kernel_size": 2, "image_mean": [0.5] * 3}
    image["image_std"] = [0.5] * 3
    (folder / "processor_config.json").write_text(json.dumps({"image_processor": image}))
    return folder


def png(width: int = 64, height: int = 64, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A picture of noise (each seed its own), encoded in ``fmt``."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


# Hostile pictures: what reading an image must refuse before it decodes the pixels.


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_claiming(width: int, height: int, rows: int = 1) -> bytes:
    """A grey PNG whose header claims ``width`` x ``height``, with ``rows`` rows of zeros compressed behind it."""
    header = _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
    pixels = zlib.compress((b"\x00" + b"\x00" * width) * rows, 9)
    return b"\x89PNG\r\n\x1a\n" + header + _png_chunk(b"IDAT", pixels) + _png_chunk(b"IEND", b"")


def truncated_jpeg() -> bytes:
    whole = png(64, 64, fmt="JPEG")
    return whole[: len(whole) // 2]  # past the header: the size reads, the pixels do not


# Qwen's vision markers: an image part renders as <|vision_start|><|image_pad|><|vision_end|>, and the processor
# expands <|image_pad|> into one per merged patch.
QWEN_VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% elif p['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The Qwen3.5 language model's own fields: linear-attention (gated delta) layers, every second one full attention.
QWEN3_5_TEXT = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
}
QWEN3_5_MOE_TEXT = {
    **QWEN3_5_TEXT,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True,
}


def make_tiny_qwen3_vl(
    folder: Path,
    seed: int = 0,
    hidden: int = 256,
    layers: int = 4,
    patch: int = 8,
    vision_hidden: int = 64,
    max_pixels: int = 64 * 64,
    model_type: str = "qwen3_vl",
) -> Path:
    """A Qwen3-VL (its vision tower with deepstack mergers, a qwen3-shaped language model with M-RoPE) of random
    weights; with ``model_type`` qwen3_5 or qwen3_5_moe, a Qwen3.5 (the same vision tower without deepstack, a
    hybrid language model of gated delta and full attention layers, the latter with a partial M-RoPE). Patches of
    ``patch`` pixels merged 2 by 2: a 64 x 48 image becomes 4 x 3 image tokens; Qwen3-VL's vision tower's first
    two layers feed deepstack features to the language model's first two layers."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_vlm.utils import get_model_and_args

    folder.mkdir(parents=True)
    # Room made for specials up to a multiple of 4: qwen3_5's shard() splits the vocabulary evenly over the ranks.
    room = -(len(SPECIALS) + len(QWEN_VISION_SPECIALS) + 96) % 4
    vocab = _tokenizer(folder, QWEN_VL_TEMPLATE, QWEN_VISION_SPECIALS + [f"<|unused_{i}|>" for i in range(room)])
    head_dim = 64
    qwen3_5 = model_type != "qwen3_vl"
    text: dict = {
        "model_type": model_type + "_text" if qwen3_5 else model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": len(vocab),
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    if qwen3_5:
        # M-RoPE over half of each head (16 frequencies): t, h and w sections, interleaved.
        section = {"mrope_section": [6, 5, 5], "mrope_interleaved": True, "rope_theta": 10000.0}
        text["rope_parameters"] = {"type": "default", "partial_rotary_factor": 0.5, **section}
        text.update(QWEN3_5_MOE_TEXT if model_type == "qwen3_5_moe" else QWEN3_5_TEXT)
    else:
        # Interleaved M-RoPE over head_dim / 2 frequencies: t, h and w sections.
        text["rope_scaling"] = {"rope_type": "default", "mrope_section": [12, 10, 10], "mrope_interleaved": True}
    config = {
        "model_type": model_type,
        "image_token_id": vocab["<|image_pad|>"],
        "video_token_id": vocab["<|video_pad|>"],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
        "eos_token_id": vocab["<|im_end|>"],
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "model_type": model_type,
            "depth": 2,
            "hidden_size": vision_hidden,
            "intermediate_size": vision_hidden * 2,
            "out_hidden_size": hidden,
            "num_heads": 2,
            "patch_size": patch,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [] if qwen3_5 else [0, 1],
            "in_channels": 3,
        },
    }
    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(model_config)
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    # Deepstack features as large as the hidden states they join, so that a rank leaving them out changes tokens.
    for merger in model.vision_tower.deepstack_merger_list:
        merger.linear_fc2.weight = merger.linear_fc2.weight * 30.0
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "patch_size": patch,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "min_pixels": (patch * 2) ** 2,
                "max_pixels": max_pixels,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
            }
        )
    )
    return folder


def mlx_vlm_tokens(model_path: Path, messages: list[dict], pictures: list[bytes], max_tokens: int = 12) -> list[str]:
    """mlx-vlm's own greedy generation for a chat (image parts as ``{"type": "image"}``) rendered by the model's
    template, each token as its text (one character each in the tiny vocabulary)."""
    from mlx_vlm import generate, load
    from PIL import Image

    model, processor = load(str(model_path))
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [Image.open(io.BytesIO(p)) for p in pictures] or None
    result = generate(model, processor, prompt, image=images, max_tokens=max_tokens, temperature=0.0)
    eos = model.config.eos_token_id
    ids = [t for t in result.token_ids if t not in (eos if isinstance(eos, list) else [eos])]
    return [processor.tokenizer.decode([t]) for t in ids]


def as_mlx_vlm(content: list[dict]) -> list[dict]:
    """A chat message's parts as mlx-vlm's templates take them: each ``image_url`` part a ``{"type": "image"}``."""
    return [{"type": "image"} if p["type"] == "image_url" else p for p in content]


def tokens_of(reply: dict) -> list[str]:
    return [t["token"] for t in reply["choices"][0]["logprobs"]["content"]]


async def solo_and_together(url: str, bodies: list[dict]) -> tuple[list[list[str]], list[list[str]]]:
    """Each chat's tokens sent alone, one after the other, then all of them at once."""
    async with httpx.AsyncClient(base_url=url, timeout=180) as client:
        solo = [tokens_of((await client.post("/v1/chat/completions", json=b)).json()) for b in bodies]
        together: list[list[str]] = [[] for _ in bodies]

        async def one(i: int) -> None:
            together[i] = tokens_of((await client.post("/v1/chat/completions", json=bodies[i])).json())

        async with anyio.create_task_group() as tg:
            for i in range(len(bodies)):
                tg.start_soon(one, i)
    return solo, together


# ``once(key, make)``, tests/e2e/vision/conftest.py's fixture: what ``make`` gives, made the first time a module asks
# for ``key``.
Once = Callable[[object, Callable[[], Any]], Any]
