"""The model's own multi-token-prediction layer as the draft (``--speculate mtp``), whole on rank 0.

DeepSeek V3 ships one (GLM-4.5 too, in the same layout): after its last layer, layer ``num_hidden_layers`` holds
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and one decoder layer of the model's own kind. Its
embedding and head are the model's (the DeepSeek-V3 report: the module shares them; the checkpoint's copies are
not loaded twice). mlx-lm's ``sanitize`` drops the layer; this loads it beside the model, on rank 0 alone.

At position i it reads the model's final hidden state h_i (after the final norm) and the next token x_{i+1}:

    g_i = block(eh_proj([enorm(embed(x_{i+1})), hnorm(h_i)]))   (attending over its own earlier positions)
    logits_i = head(shared_head.norm(g_i))                     (a guess at x_{i+2})

as vLLM's ``deepseek_mtp.py`` computes it, the embedding at position 0 zeroed. For k > 1 the one layer runs again
on its own output g in place of h (vLLM's recursion): the later draft tokens rest on the layer's guesses.

Qwen3-Next ships its own under ``mtp.``: ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``, one
full-attention decoder layer ``layers.0`` and ``norm`` (its norms zero-centred, as the model's are in its
checkpoints). As vLLM's ``qwen3_next_mtp.py`` computes it:

    g_i = norm(layers.0(fc([pre_fc_norm_embedding(embed(x_{i+1})), pre_fc_norm_hidden(h_i)])))
    logits_i = head(g_i)

with nothing zeroed, and the recursion runs on g (the normed output).

Where the hidden states come from: rank 0's runner keeps those of every position it feeds
(``runner.Sliced.keep_states``, ``fed_states``): a prompt's, its layers computed them anyway, and every position
a decode step feeds, draft included; each sequence's state collects them (``rank.kv.sequence.SeqState.seen``). A
sequence's layer cache is fed the positions the target kept, in order, each with the target's hidden state (the
whole prompt in the first pass, as vLLM fills its MTP layer's cache); the positions a proposal adds are cut back
after it, since the target's states replace the layer's own guesses there. Where a step kept no hidden states (a
step run ahead, a prompt restored from the prefix cache up to where it was fed) the layer starts afresh from the
next one that did: the drafts are worse, never wrong, since the target verifies them. Rotary positions in its
cache count from where it started: attention sees the same offsets between positions. Under TP rank 0's hidden
states are whole once each layer's all-reduce has joined the slices. In a pipeline rank 0 receives the last
stage's for its head (``runner.Stage``) and keeps them alike, but only of the positions it projects: a prompt's
body stays on the last stage, and the layer starts at the prompt's last token there.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from neuron.models.architectures import MTP
from neuron.models.folder import read_config, text_config
from neuron.rank.failures import RankError
from neuron.rank.head.drafter import Proposal, draw, new_key
from neuron.rank.model.parts import backbone
from neuron.rank.runner import Sliced, Stage
from neuron.step import DraftRow

if TYPE_CHECKING:
    from neuron.rank.kv.sequence import Seen, SeqState

# Each architecture's decoder layer class in mlx-lm, built as the layer at index num_hidden_layers.
BLOCKS = {"deepseek_v3": "DeepseekV3DecoderLayer", "glm4_moe": "DecoderLayer", "qwen3_next": "Qwen3NextDecoderLayer"}
SHARED = ("embed_tokens.", "shared_head.head.")  # the model's own, not loaded again
OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
NEXT_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")  # Qwen3-Next's own


class _SharedHead(nn.Module):
    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dims, eps=eps)


class MtpLayer(nn.Module):
    """DeepSeek V3's layout (GLM-4.5's too)."""

    zero_first = True  # vLLM's: nothing precedes position 0, its embedding is zeroed

    def __init__(self, dims: int, eps: float, block: nn.Module) -> None:
        super().__init__()
        self.enorm = nn.RMSNorm(dims, eps=eps)
        self.hnorm = nn.RMSNorm(dims, eps=eps)
        self.eh_proj = nn.Linear(2 * dims, dims, bias=False)
        self.block = block
        self.shared_head = _SharedHead(dims, eps)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        """g for each position (1, positions, dims), from the next tokens' embeddings and the hidden states."""
        x = self.eh_proj(mx.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1))
        return self.block(x, create_attention_mask(x, cache, return_array=True), cache)

    def final(self, g: mx.array) -> mx.array:
        """What the head reads."""
        return self.shared_head.norm(g)


class NextMtpLayer(nn.Module):
    """Qwen3-Next's layout."""

    zero_first = False

    def __init__(self, dims: int, eps: float, block: nn.Module) -> None:
        super().__init__()
        self.pre_fc_norm_embedding = nn.RMSNorm(dims, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(dims, eps=eps)
        self.fc = nn.Linear(2 * dims, dims, bias=False)
        self.layers = [block]
        self.norm = nn.RMSNorm(dims, eps=eps)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1))
        return self.norm(self.layers[0](x, create_attention_mask(x, cache, return_array=True), cache))

    def final(self, g: mx.array) -> mx.array:
        return g


@dataclass(slots=True)
class _Held:
    cache: KVCache
    end: int  # the position after the last one its cache holds
    key: mx.array | None


class MtpDrafter:
    """Rank 0's drafts from the model's prediction layer, one sequence at a time, each with its layer cache."""

    def __init__(
        self,
        layer: MtpLayer | NextMtpLayer,
        embed: nn.Module,
        head: nn.Module,
        seqs: dict[int, SeqState],
        vocab_size: int,
    ) -> None:
        self.held: dict[int, _Held] = {}  # by sequence; the head drops a sequence's as it leaves
        self.layer: MtpLayer | NextMtpLayer = layer
        self.embed = embed
        self.head = head
        self.seqs = seqs  # the rank's sequences, whose ``seen`` the target's steps fill
        self.vocab_size = vocab_size

    @classmethod
    def load(
        cls, path: str, model: nn.Module | None, runner: Sliced | Stage | None, seqs: dict[int, SeqState], vocab: int
    ) -> MtpDrafter:
        """The prediction layer of the model at ``path``, which rank 0 has loaded (``model``, run by ``runner``, its
        sequences ``seqs``); from now on rank 0's runner keeps the hidden states it drafts from."""
        config = text_config(read_config(path))
        arch, layers = str(config.get("model_type")), int(config["num_hidden_layers"])
        if arch not in MTP or model is None:
            raise RankError(f"rank 0: neuron runs the prediction layers of {', '.join(sorted(MTP))} only, not {arch}")
        if runner is None:
            raise RankError("rank 0: no model loaded; load the model before its prediction layer")
        quantization = read_config(path).get("quantization")
        loaded = _load_next if arch == "qwen3_next" else _load_deepseek
        layer = loaded(Path(path), model, layers, quantization)
        mx.eval(layer.parameters())
        trunk = backbone(model)
        head = getattr(model, "lm_head", None) or trunk.embed_tokens.as_linear
        if isinstance(runner, Stage):  # rank 0 holds the embedding and the head of a pipeline (runner.Stage)
            assert runner.project is not None
            head = runner.project
        runner.keep_states = True
        return cls(layer, trunk.embed_tokens, head, seqs, vocab)

    def propose(self, rows: list[DraftRow]) -> dict[int, Proposal]:
        """``k`` tokens for each row whose latest hidden states rank 0 holds; none for the others."""
        out = {}
        for row in rows:
            state = self.seqs.get(row.seq)
            if row.k <= 0 or state is None:
                continue
            seen, state.seen = state.seen, []
            if (pairs := _pairs(seen, row.context)) is None:
                continue
            at, hidden, following = pairs
            h = self.held.get(row.seq)
            if h is None or not (h.end - h.cache.offset <= at <= h.end):  # it cannot continue there: afresh
                h = self.held[row.seq] = _Held(KVCache(), at, h.key if h is not None else new_key(row))
            if cut := h.end - at:
                h.cache.trim(cut)
            out[row.seq] = self._draft(row, h, at, hidden, following)
            h.end = len(row.context) - 1
        return out

    def _draft(self, row: DraftRow, h: _Held, at: int, hidden: mx.array, following: list[int]) -> Proposal:
        embedded = self.embed(mx.array(following))[None]
        if at == 0 and self.layer.zero_first:
            embedded = mx.concatenate([mx.zeros_like(embedded[:, :1]), embedded[:, 1:]], axis=1)
        g = self.layer(embedded, hidden[None], h.cache)[:, -1:]
        tokens, qs = [], []
        for j in range(row.k):
            logits = self.head(self.layer.final(g))[:, -1, : self.vocab_size]
            token, q = draw(logits, [row], [h])
            tokens.append(token)
            if q is not None:
                qs.append(q[0])
            if j + 1 < row.k:
                g = self.layer(self.embed(token[:, None]), g, h.cache)
        drafted = mx.concatenate(tokens)
        mx.eval(drafted, qs, h.cache.keys, h.cache.values)
        if row.k > 1:  # the positions the layer guessed at: the target's own states replace them next time
            h.cache.trim(row.k - 1)
        return Proposal(drafted.tolist(), mx.stack(qs) if qs and row.params.temperature > 0.0 else None)  # type: ignore[arg-type]


def _load_deepseek(path: Path, model: nn.Module, layers: int, quantization: dict[str, Any] | None) -> MtpLayer:
    """DeepSeek V3's layer (GLM-4.5's): the checkpoint's layer ``layers``."""
    prefix = f"model.layers.{layers}."
    weights = _read(path, prefix)
    if not weights:
        raise RankError(_dropped(path, prefix))
    args = model.args
    # mlx-lm's own sanitize stacks the layer's experts (and splits MLA's kv_b_proj) when told it is a model layer
    sanitized = type(model).sanitize(  # type: ignore[attr-defined]
        SimpleNamespace(args=dataclasses.replace(args, num_hidden_layers=layers + 1)), weights
    )
    local: dict[str, mx.array] = {}
    for name, value in sanitized.items():
        name = name.removeprefix(prefix)
        if not name.startswith(SHARED):
            local[name if name.startswith(OWN) else f"block.{name}"] = value
    arch = str(args.model_type)
    block = getattr(importlib.import_module(f"mlx_lm.models.{arch}"), BLOCKS[arch])(args, layers)
    return _filled(MtpLayer(args.hidden_size, args.rms_norm_eps, block), local, path, quantization)


def _load_next(path: Path, model: nn.Module, layers: int, quantization: dict[str, Any] | None) -> NextMtpLayer:
    """Qwen3-Next's layer: the checkpoint's ``mtp.*``, its decoder layer one of full attention."""
    weights = _read(path, "mtp.")
    if not weights:
        raise RankError(_dropped(path, "mtp."))
    args = model.args
    at = layers + (-(layers + 1)) % args.full_attention_interval  # the first index past the model's of that kind
    inner = f"model.layers.{at}."
    # mlx-lm's sanitize stacks the decoder layer's experts and shifts its zero-centred norms, as a model layer's;
    # the prediction layer's own norms are shifted alike where it ran (a checkpoint of split experts).
    renamed = {
        (inner + k.removeprefix("mtp.layers.0.") if k.startswith("mtp.layers.0.") else k): v for k, v in weights.items()
    }
    sanitized = type(model).sanitize(SimpleNamespace(args=args), dict(renamed))  # type: ignore[attr-defined]
    shifted = any(".experts.0." in name for name in weights)
    local: dict[str, mx.array] = {}
    for name, value in {**sanitized, **{k: v for k, v in renamed.items() if k.startswith("mtp.")}}.items():
        if name.startswith(inner):
            local[f"layers.0.{name.removeprefix(inner)}"] = value
        elif name.startswith("mtp."):
            own = name.removeprefix("mtp.")
            local[own] = value + 1.0 if shifted and own in NEXT_NORMS else value
    block = getattr(importlib.import_module("mlx_lm.models.qwen3_next"), BLOCKS["qwen3_next"])(args, at)
    return _filled(NextMtpLayer(args.hidden_size, args.rms_norm_eps, block), local, path, quantization)


def _filled(layer: Any, local: dict[str, mx.array], path: Path, quantization: dict[str, Any] | None) -> Any:
    if quantization:
        nn.quantize(
            layer,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda p, _: f"{p}.scales" in local,
        )
    try:
        layer.load_weights(list(local.items()), strict=True)
    except ValueError as e:
        raise RankError(f"rank 0: the prediction layer in {path} does not fit its config: {e}") from e
    return layer


def _dropped(path: Path, prefix: str) -> str:
    return (
        f"rank 0: {path} declares multi-token-prediction layers but its weights hold no {prefix}*: a "
        "conversion dropped them (mlx-lm's convert does); serve the original checkpoint, or --speculate ngram"
    )


def _pairs(seen: list[Seen], context: list[int]) -> tuple[int, mx.array, list[int]] | None:
    """From the steps' records, the positions the target kept up to the context's last fed one (len - 2), joined:
    the first position, their hidden states (positions, dims) and the tokens after each. None where the last of
    them is not there (no hidden states kept since)."""
    last = len(context) - 2  # the position whose logits drew the context's last token
    start, states = -1, list[mx.array]()
    for record in seen:
        kept = 0
        while (
            kept < len(record.tokens) and record.at + kept <= last and record.tokens[kept] == context[record.at + kept]
        ):
            kept += 1
        if not kept:
            continue
        if start < 0 or record.at != start + sum(s.shape[0] for s in states):
            start, states = record.at, []  # a gap, or an overlap: what came before does not join
        states.append(record.hidden[:kept])
    length = sum(s.shape[0] for s in states)
    if start < 0 or start + length - 1 != last:
        return None
    return start, mx.concatenate(states), context[start + 1 : last + 2]


def _read(folder: Path, prefix: str) -> dict[str, Any]:
    """The weights under ``prefix``, from the safetensors files that hold them (the index says which, where
    there is one)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = {file for name, file in json.loads(index.read_text())["weight_map"].items() if name.startswith(prefix)}
        files = [folder / name for name in sorted(names)]
    else:
        files = sorted(folder.glob("*.safetensors"))
    out: dict[str, Any] = {}
    for file in files:
        out.update((k, v) for k, v in mx.load(str(file)).items() if k.startswith(prefix))  # type: ignore[union-attr]
    return out
