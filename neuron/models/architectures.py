"""What neuron serves of each model architecture, and how: the one table every check and the README read.

No MLX here: the leader checks a model against this table before it spawns a
worker or a worker reads a weight (``rank.model.share.check_splittable``), and the
docs' architectures reference is written from it as the site builds (neuron/cli/reference.py;
``python -m neuron.models.architectures`` prints the table).

The caches a model builds decide the rest. Plain key/value caches can be cut
back to any length, so a prefix-cache entry restores any beginning of a saved
prompt and a rejected draft is trimmed away. A sliding window's cache has
forgotten what fell out of the window, and a linear-attention layer keeps one
state for the whole past: neither can be cut back, so such a model's prefix
entries are snapshots restored only whole, at the end of the prompt they saved
(a chat's next turn starts there). A linear-attention layer keeps its state
after each position a verify step feeds (``rank.kv.states``), so a rejected draft
is dropped there too; a sliding window's model runs without drafting (see
``Support`` and ``limits_for``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

# What each layer's cache is, as mlx-lm builds it (``make_cache``): named for the README and the refusals.
KV = "key/value"
WINDOW = "key/value + sliding window"
STATE = "key/value + linear-attention state"


@dataclass(frozen=True, slots=True)
class Support:
    caches: str  # KV, WINDOW or STATE
    tp: str | None  # who splits its layers over tensor-parallel ranks: "mlx-lm" (its ``shard()``), "neuron"
    # (rank/model/splits.py), or None: nobody
    pp: bool  # pipeline stages: a stage runs a run of its layers
    batching: bool = True  # continuous batching: joins, leaves, chunked prompts, n > 1 copies
    images: bool = False  # image input: mlx-vlm's vision tower on rank 0, its features in the prompt (rank.vision)

    @property
    def cuttable(self) -> bool:
        """Whether every layer's cache can be cut back to an earlier length."""
        return self.caches == KV

    @property
    def prefix_cache(self) -> str:
        """Which beginnings of a saved prompt a later one restores."""
        return "any shared beginning" if self.cuttable else "a whole saved prompt"

    @property
    def speculation(self) -> bool:
        """Whether a rejected draft can be dropped: cut from key/value caches, or a linear-attention state taken
        back to the last position kept (``rank.kv.states``); a wrapped sliding window has lost what it would need."""
        return self.caches != WINDOW

    @property
    def run_ahead(self) -> bool:
        """Whether decode may run a step ahead of its plan (``rank.ahead``): a plan that differs drops its token."""
        return self.cuttable


# By ``model_type``. mistral is llama's code in mlx-lm; with ``layer_types`` naming sliding layers it is WINDOW.
TABLE: dict[str, Support] = {
    "llama": Support(KV, "mlx-lm", pp=True),
    "mistral": Support(KV, "mlx-lm", pp=True),
    # Mistral 3's vision-language model: its llama-shaped language model split by mlx-lm's shard(), called from
    # neuron's plan (rank/model/splits.py), since the vision tower beside it stays whole on rank 0.
    "mistral3": Support(KV, "neuron", pp=True, images=True),
    # Qwen3-VL: a qwen3 language model with multimodal rotary positions (rank/model/mrope.py), split as mistral3's.
    "qwen3_vl": Support(KV, "neuron", pp=True, images=True),
    "qwen2": Support(KV, "mlx-lm", pp=True),
    "qwen3": Support(KV, "mlx-lm", pp=True),
    "qwen3_moe": Support(KV, "mlx-lm", pp=True),
    "deepseek_v3": Support(KV, "mlx-lm", pp=True),
    "glm4_moe": Support(KV, "mlx-lm", pp=True),
    "phi3": Support(KV, "neuron", pp=True),
    "granite": Support(KV, "neuron", pp=True),
    "olmo2": Support(KV, "neuron", pp=True),
    # Qwen3.5/3.6, natively multimodal: a hybrid language model (gated delta and full attention layers, the latter
    # with a partial M-RoPE, rank/model/mrope.py), and its MoE form.
    "qwen3_5": Support(STATE, "mlx-lm", pp=True, images=True),
    "qwen3_5_moe": Support(STATE, "mlx-lm", pp=True, images=True),
    "qwen3_next": Support(STATE, "neuron", pp=True),
    "gpt_oss": Support(WINDOW, "mlx-lm", pp=True),
    "gemma3_text": Support(WINDOW, "neuron", pp=True),
    # Gemma 3's vision-language model: its gemma3_text language model split by neuron's plan, the vision tower
    # whole on rank 0.
    "gemma3": Support(WINDOW, "neuron", pp=True, images=True),
    "gemma4": Support(WINDOW, "neuron", pp=True, images=True),  # Gemma 4's, likewise
    "gemma4_text": Support(WINDOW, "neuron", pp=True),
}
# Architectures whose code reads ``layer_types`` for sliding layers the way mlx-lm's llama.py does.
_LAYER_TYPED = frozenset({"llama", "mistral", "mistral3"})


class Unsupported(ValueError):
    """A model, or a way of serving it, that neuron does not serve; the message says what to use instead."""


def architecture(config: dict[str, Any]) -> str:
    return str(config.get("model_type", "?"))


def windowed(config: dict[str, Any]) -> bool:
    """Whether a llama-shaped model has sliding layers, read as mlx-lm reads it: from ``layer_types`` alone
    (a Mistral-7B-v0.1 config sets ``sliding_window`` without them, and mlx-lm attends in full on every layer)."""
    text = config.get("text_config", config)
    return "sliding_attention" in (text.get("layer_types") or [])


def kept_together(config: dict[str, Any]) -> list[tuple[int, int]]:
    """Pairs of layers that one pipeline stage must hold both of, (source, reader): gemma4's last
    ``num_kv_shared_layers`` keep no keys and values of their own and read those of the last earlier layer of
    their kind (sliding or full), as mlx-lm's ``Gemma4TextModel`` wires them."""
    text = config.get("text_config", config)
    shared = int(text.get("num_kv_shared_layers") or 0)
    if architecture(config) not in ("gemma4_text", "gemma4") or not shared:
        return []
    layers = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if not isinstance(types, list):  # mlx-lm's default: every ``sliding_window_pattern``-th layer is full
        pattern = int(text.get("sliding_window_pattern") or 5)
        types = ["full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(layers)]
    last_of_kind = {kind: i for i, kind in enumerate(types[: layers - shared])}
    return [(last_of_kind[types[j]], j) for j in range(layers - shared, layers) if types[j] in last_of_kind]


def supports(config: dict[str, Any]) -> Support | None:
    """What neuron serves of a model with this config; None for an architecture outside the table (served as
    before it: one rank or mlx-lm's ``shard()``, plain key/value caches only, checked when the ranks load it)."""
    arch = architecture(config)
    if arch not in TABLE:
        return None
    support = TABLE[arch]
    if arch in _LAYER_TYPED and windowed(config):
        return Support(WINDOW, support.tp, pp=support.pp, images=support.images)
    if arch in ("gemma4_text", "gemma4") and config.get("text_config", config).get("enable_moe_block"):
        # neuron's plan splits attention and the MLP, not its experts
        return Support(WINDOW, None, pp=True, images=support.images)
    return support


def check(config: dict[str, Any], world_size: int, stages: int) -> Support | None:
    """Refuse, before anything loads, a model the table says cannot be served this way; each refusal names the
    architecture and what to use instead."""
    support = supports(config)
    arch = architecture(config)
    if stages > 1 and (support is None or not support.pp):
        staged = sorted(a for a, s in TABLE.items() if s.pp)
        raise Unsupported(
            f"neuron does not split {arch!r} into pipeline stages (it stages {', '.join(staged)}); "
            "serve it with --tp instead of --pp"
        )
    if support is not None and stages == 1 and world_size > 1 and support.tp is None:
        instead = "--tp 1, or --pp to split its layers over the ranks" if support.pp else "--tp 1"
        raise Unsupported(
            f"neither mlx-lm (it has no shard() for {arch!r}) nor neuron (rank/model/splits.py) splits {arch!r} over "
            f"tensor-parallel ranks; serve it with {instead}"
        )
    return support


def check_kv_bits(config: dict[str, Any], bits: int | None, group_size: int) -> None:
    """Refuse a quantized KV cache (``--kv-bits``) for a model that cannot hold one. mlx-lm quantizes only plain
    key/value caches (its ``RotatingKVCache.to_quantized`` is not implemented, and a linear-attention state is no
    key/value cache); latent attention (deepseek_v3) multiplies its cached latent directly, which a quantized cache
    does not hold; and mlx-lm's quantized attention needs each head's width to be whole groups."""
    if bits is None:
        return
    support = supports(config)
    arch = architecture(config)
    text = config.get("text_config", config)
    why = ""
    if support is not None and not support.cuttable:
        why = f"its caches are {support.caches} ones, and mlx-lm quantizes plain key/value caches only"
    elif text.get("kv_lora_rank"):
        why = "its latent attention reads the cached latent unquantized"
    else:
        heads = text.get("num_attention_heads") or 1
        head_dim = int(text.get("head_dim") or text.get("hidden_size", 0) // heads)
        if head_dim % group_size:
            why = f"its heads are {head_dim} wide, not a multiple of the quantization group of {group_size}"
    if why:
        raise Unsupported(
            f"--kv-bits {bits}: {arch!r} cannot keep a quantized KV cache: {why}; serve it without --kv-bits"
        )


class _Limits(Protocol):
    @property
    def speculate(self) -> str: ...


Settings = TypeVar("Settings", bound=_Limits)  # the engine's Scheduling (a frozen dataclass)


def limits_for(config: dict[str, Any], limits: Settings) -> tuple[Settings, list[str]]:
    """``limits`` with what this model cannot do turned off, and a line saying why for each, for the startup log:
    drafting needs rejected tokens dropped from every layer's cache, which a sliding window cannot (BENCHMARKS.md,
    "Speculation where caches cannot be cut", measured what undoing them instead would cost)."""
    support = supports(config)
    if support is None or support.speculation or limits.speculate == "off":
        return limits, []
    arch = architecture(config)
    note = (
        f"speculative decoding off for {arch!r}: its caches ({support.caches}) cannot be cut back to an earlier "
        "length, so rejected draft tokens cannot be dropped"
    )
    return replace(limits, speculate="off"), [note]  # type: ignore[type-var]


# Architectures whose multi-token-prediction layers neuron runs as the draft (``--speculate mtp``, rank/head/mtp.py):
# DeepSeek V3's layout (GLM-4.5 ships the same), one decoder layer of the model's own kind after its last, and
# Qwen3-Next's (``mtp.*``).
MTP = frozenset({"deepseek_v3", "glm4_moe", "qwen3_next"})


def mtp_heads(config: dict[str, Any]) -> int:
    """The multi-token-prediction layers a model's config declares (DeepSeek V3 and GLM-4.5's
    ``num_nextn_predict_layers``, Qwen3-Next and Qwen3.5's ``mtp_num_hidden_layers``)."""
    text = config.get("text_config", config)
    return int(text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers") or 0)


def mtp_refusal(config: dict[str, Any], name: str) -> str | None:
    """Why ``--speculate mtp`` cannot draft with this model's own prediction heads, or None where it can (in
    stages too: rank 0 receives the final hidden states from the last stage for its head, ``runner.Stage``)."""
    arch = architecture(config)
    support = supports(config)
    heads = mtp_heads(config)
    if support is not None and not support.speculation:
        return (
            f"{name} ({arch}) ships {heads} multi-token-prediction layer(s), but its caches ({support.caches}) "
            "cannot drop a rejected draft, so it does not speculate at all; use --speculate off"
        )
    if not heads:
        return (
            f"{name} ({arch}) ships no multi-token-prediction layers (its config declares no "
            "num_nextn_predict_layers or mtp_num_hidden_layers); use --draft-model or --speculate ngram"
        )
    if arch not in MTP:
        return (
            f"{name} ({arch}) declares {heads} multi-token-prediction layer(s), but neuron runs those of "
            f"{', '.join(sorted(MTP))} only; use --draft-model or --speculate ngram"
        )
    return None


def markdown() -> str:
    """The docs' table of architectures, one row each."""
    rows = [
        "| architecture | caches | `--tp` | `--pp` | batching | prefix cache restores | speculation | running ahead "
        "| images |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    mark = {True: "yes", False: "no"}
    windowed_mistral = supports({"model_type": "mistral", "layer_types": ["sliding_attention"]})
    assert windowed_mistral is not None
    for arch, s in [*TABLE.items(), ("mistral / llama with sliding `layer_types`", windowed_mistral)]:
        tp = {"mlx-lm": "mlx-lm's `shard()`", "neuron": "neuron's plan"}.get(s.tp or "", "no")
        rows.append(
            f"| {arch} | {s.caches} | {tp} | {mark[s.pp]} | {mark[s.batching]} | {s.prefix_cache} "
            f"| {mark[s.speculation]} | {mark[s.run_ahead]} | {mark[s.images]} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
