"""Tiny random-weight models with a real tokenizer, for the tests and the benchmarks.

Tiny models have 4 attention heads and 2 key/value heads, so they split over 1, 2 or 4 ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A Qwen-style template that renders tools and earlier calls: mlx-lm reads its calls with its json_tools parser.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    'For each call return <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}{% set tool_call = c.function %}<tool_call>"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# GLM-4.5's own config fields (glm4_moe), for a tiny one: 4 routed experts and a shared one, the first layer dense.
GLM4_MOE = {
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "use_qk_norm": True,
    "attention_bias": False,
    "partial_rotary_factor": 0.5,
    "rope_scaling": None,
}


# Qwen3-Next's own config fields (qwen3_next) that do not scale with its width, for a generated one: a full
# attention layer every fourth, the others gated delta nets; 4 routed experts, 2 per token, and a shared one.
QWEN3_NEXT = {
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
}


def with_template(model: Path, folder: Path, template: str) -> Path:
    """A copy of ``model`` whose tokenizer has another chat template."""
    shutil.copytree(model, folder)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def tokenizer_files(folder: Path) -> int:
    """A byte-level BPE tokenizer with no merges: every byte is a token. Returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return len(vocab)


def make_tiny_model(
    folder: Path,
    model_type: str,
    seed: int = 0,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    intermediate: int | None = None,
    vocab: int | None = None,
    extra: dict | None = None,
) -> Path:
    """A random-weight model with a real tokenizer; the defaults are the tests' tiny one (the benchmarks grow it).
    ``extra``: the architecture's own config fields."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes

    folder.mkdir(parents=True)
    vocab = max(tokenizer_files(folder), vocab or 0)  # ids past the tokenizer's are never produced, only computed
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate or hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": model_type == "qwen3",
        "eos_token_id": 2,
        **(extra or {}),
    }
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # At default init, greedy decoding of a random model repeats one token; larger
    # matrices make it wander, so that a token-by-token comparison means something.
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# A Qwen3-style thinking model: `<think>` and `</think>` are tokens of its own (added, not special, as Qwen3's), its
# template renders tools and opens the thinking section for the model unless `enable_thinking` is false.
THINKING_TEMPLATE = TOOLS_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}",
)


def make_thinking_model(folder: Path) -> Path:
    """A tiny qwen3 whose tokenizer has thinking markers and whose template thinks (THINKING_TEMPLATE)."""
    from tokenizers import AddedToken, Tokenizer

    make_tiny_model(folder, "qwen3", seed=3, vocab=len(SPECIALS) + 256 + 8)  # room for the two markers
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    return folder


def cut_layers(model: Path, folder: Path, layers: int) -> Path:
    """A copy of ``model`` with only its first ``layers`` layers (its embedding, final norm and head kept): a draft
    model cut from the model itself, whose tokenizer is the model's."""
    import mlx.core as mx

    shutil.copytree(model, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    config = json.loads((model / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    weights: dict[str, mx.array] = {}
    for file in sorted(model.glob("*.safetensors")):
        for name, value in mx.load(str(file)).items():  # type: ignore[union-attr]
            index = _layer_of(name)
            if index is None or index < layers:
                weights[name] = value
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


def file_per_layer(model: Path, folder: Path) -> Path:
    """A copy of ``model`` whose weights lie one layer to a file, as a large model's are sharded on the Hub: the
    embedding, final norm and head in the first file, each layer's in one of its own, and the index naming each
    tensor's file (``model.safetensors.index.json``)."""
    import mlx.core as mx

    shutil.copytree(model, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    groups: dict[int, dict[str, mx.array]] = {}
    for file in sorted(model.glob("*.safetensors")):
        for name, value in mx.load(str(file)).items():  # type: ignore[union-attr]
            layer = _layer_of(name)
            groups.setdefault(-1 if layer is None else layer, {})[name] = value
    weight_map = {}
    for number, key in enumerate(sorted(groups), start=1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        mx.save_safetensors(str(folder / name), groups[key])
        weight_map |= dict.fromkeys(groups[key], name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


QUIETED = ("o_proj.weight", "down_proj.weight", "linear_attn.out_proj.weight")  # what each layer adds through


def quiet_layers(model: Path, first: int, factor: float) -> Path:
    """Scale the output projections (attention's and the MLP's) of layers ``first``.. of ``model`` by ``factor``,
    in place: with 0 those layers add nothing to the residual stream, so the model computes what its first
    ``first`` layers compute, and a draft cut to them (``cut_layers``) agrees with it exactly; a small factor makes
    them agree mostly. A linear-attention layer's output projection is ``out_proj``."""
    import mlx.core as mx

    for file in sorted(model.glob("*.safetensors")):
        weights = dict(mx.load(str(file)).items())  # type: ignore[union-attr]
        for name, value in weights.items():
            index = _layer_of(name)
            if index is not None and index >= first and name.endswith(QUIETED):
                weights[name] = value * factor
        mx.save_safetensors(str(file), weights)
    return model


def add_prediction_layer(model: Path, seed: int = 1, exact: bool = False) -> Path:
    """Give ``model`` (a glm4_moe, deepseek_v3 or qwen3_next) a multi-token-prediction layer as their checkpoints
    hold it, in place: layer ``num_hidden_layers`` (Qwen3-Next's ``mtp.*``), random; with ``exact``, one that
    computes what the model computes once every layer's output projections are zeroed (``quiet_layers(model, 0,
    0.0)``): the model's next token is then a function of the current token's embedding, which the layer reproduces
    through an ``eh_proj`` (``fc``) that passes the embedding and a decoder layer that adds nothing, its final norm
    the model's."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    from neuron.rank.head.mtp import BLOCKS, MtpLayer

    config = json.loads((model / "config.json").read_text())
    if config["model_type"] == "qwen3_next":
        return _add_next_prediction_layer(model, config, seed, exact)
    layers, dims = config["num_hidden_layers"], config["hidden_size"]
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    layer = MtpLayer(dims, config["rms_norm_eps"], getattr(module, BLOCKS[config["model_type"]])(args, layers))
    layer.update(tree_map(lambda p: p * 4.0 if p.ndim >= 2 else p, layer.parameters()))
    weights = dict(mx.load(str(model / "model.safetensors")).items())  # type: ignore[union-attr]
    mine = dict(tree_flatten(layer.parameters()))
    if exact:
        mine["eh_proj.weight"] = mx.concatenate([mx.eye(dims), mx.zeros((dims, dims))], axis=1)
        mine = {
            k: mx.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v for k, v in mine.items()
        }
        mine["shared_head.norm.weight"] = weights["model.norm.weight"]
    for name, value in mine.items():
        weights[f"model.layers.{layers}.{name.removeprefix('block.')}"] = value
    mx.save_safetensors(str(model / "model.safetensors"), weights)
    (model / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return model


def _add_next_prediction_layer(model: Path, config: dict, seed: int, exact: bool) -> Path:
    """Qwen3-Next's, written as its Hugging Face checkpoints hold it: ``mtp.*``, the experts one by one and the
    norms zero-centred (the loader adds the 1 back, as mlx-lm's sanitize does for the model's)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import qwen3_next

    from neuron.rank.head.mtp import NextMtpLayer

    args = qwen3_next.ModelArgs.from_dict(config)
    layers, dims = config["num_hidden_layers"], config["hidden_size"]
    at = layers + (-(layers + 1)) % args.full_attention_interval
    mx.random.seed(seed)
    layer = NextMtpLayer(dims, config["rms_norm_eps"], qwen3_next.Qwen3NextDecoderLayer(args, at))
    layer.update(tree_map(lambda p: p * 4.0 if p.ndim >= 2 else p, layer.parameters()))
    weights = dict(mx.load(str(model / "model.safetensors")).items())  # type: ignore[union-attr]
    mine = dict(tree_flatten(layer.parameters()))
    if exact:
        mine["fc.weight"] = mx.concatenate([mx.eye(dims), mx.zeros((dims, dims))], axis=1)
        mine = {k: mx.zeros_like(v) if k.endswith(QUIETED) else v for k, v in mine.items()}
        mine["norm.weight"] = weights["model.norm.weight"]
    for name, value in mine.items():
        if ".switch_mlp." in name:  # stacked (experts, out, in): one per expert, as the checkpoint has them
            for e in range(value.shape[0]):
                weights[f"mtp.{name.replace('.switch_mlp.', f'.experts.{e}.')}"] = value[e]
            continue
        norm = value.ndim == 1 and name.endswith("norm.weight")
        weights[f"mtp.{name}"] = value - 1.0 if norm else value
    mx.save_safetensors(str(model / "model.safetensors"), weights)
    (model / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return model


def _layer_of(name: str) -> int | None:
    """The layer a weight's name puts it in (``model.layers.3.mlp...``), or None outside the layers."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None
