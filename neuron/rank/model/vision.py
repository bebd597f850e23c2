"""Images on a rank: rank 0 encodes them (mlx-vlm's vision tower and projector), and every rank that embeds the
prompt puts their features in place of the image tokens' embeddings.

Under tensor parallelism every rank embeds the prompt (the embedding is whole on each), so every rank needs the
features: rank 0 gives them to an ``all_sum`` in which the other ranks give zeros of the shape the plan fixes
(``rpc.ImageRun``): a sum with zeros is exact, so every rank feeds the very embeddings rank 0 would alone. Under
pipeline parallelism only the first stage, rank 0, embeds: no collective; but where every layer takes an input
of its own computed from the embeddings (gemma4's per-layer inputs), every stage computes them, so every stage
gets the features as tensor-parallel ranks do.

The features are what mlx-vlm's own ``get_input_embeddings`` puts in the prompt, and the embeddings fed are
mlx-lm's model's input embeddings: where mlx-lm's language model scales its input embeddings and mlx-vlm's puts
the features in after the scaling (gemma4), the features are divided by that scale first. Where per-layer inputs
are read from the tokens, an image's positions hold token 0 there, as mlx-vlm reads them.

The features of an image are computed once, on the first chunk that needs them, and kept while later chunks of a
long prompt may still need them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import structlog

from neuron import images
from neuron.rank.model import mrope
from neuron.rank.model.parts import backbone
from neuron.rpc import ImageRun

log = structlog.get_logger("neuron.vision")

# Images whose features rank 0 keeps: a long prompt's chunks may need one image's features in several steps.
KEPT_FEATURES = 32


class Encoder:
    """Rank 0's vision tower and projector, loaded by mlx-vlm from the model's folder; the language model's
    layers are dropped unread, and its embedding is the served model's (the same arrays, not a copy)."""

    def __init__(self, model_path: str, embed: nn.Module, scale: float = 1.0) -> None:
        from mlx_vlm.utils import load_model

        self.scale = scale  # what mlx-lm's model multiplies input embeddings by and mlx-vlm's does not
        vlm = load_model(Path(model_path), lazy=True)
        language = vlm.language_model
        language.model.layers = []
        language.model.embed_tokens = embed
        if "lm_head" in language:
            del language["lm_head"]
        mx.eval(vlm.parameters())
        self.vlm = vlm
        self.features: OrderedDict[str, mx.array] = OrderedDict()

    def of(self, digest: str, inputs: images.Inputs | None) -> mx.array | None:
        """The image's features, (its tokens, hidden), from its ``inputs`` (the step's, ``Step.images``) where they
        are not kept already; None where they are neither."""
        if (kept := self.features.get(digest)) is not None:
            self.features.move_to_end(digest)
            return kept
        if inputs is None:
            return None
        started = time.perf_counter()
        ids = mx.array(inputs.ids)[None]
        kwargs: dict[str, Any] = {k: mx.array(v) for k, v in inputs.arrays.items()}
        pixels = kwargs.pop("pixel_values", None)
        # mlx-vlm's own merge, on the image's placeholder tokens alone: its rows at the image token are the
        # features, scaled and projected exactly as its generate would put them in a prompt.
        out = self.vlm.get_input_embeddings(ids, pixels, mask=mx.ones_like(ids), **kwargs)
        rows = mx.array([i for i, t in enumerate(inputs.ids) if t == inputs.token])
        features = out.inputs_embeds[0][rows]
        if self.scale != 1.0:
            features = features / self.scale
        # Qwen3-VL's deepstack features (one per early layer, ``rank.model.mrope``) travel beside the image's own.
        if (deepstack := getattr(out, "deepstack_visual_embeds", None)) is not None:
            features = mx.concatenate([features, *(d.reshape(features.shape[0], -1) for d in deepstack)], axis=-1)
        mx.eval(features)
        ms = round((time.perf_counter() - started) * 1e3, 1)
        log.info("image encoded", image=digest[:12], tokens=features.shape[0], ms=ms)
        self.features[digest] = features
        while len(self.features) > KEPT_FEATURES:
            self.features.popitem(last=False)
        return features


class Images:
    """What one rank does with a chunk's images: rank 0 encodes them (``encoder``), every rank that embeds puts
    them in; ``group`` is set where the features must reach other ranks (tensor parallelism)."""

    def __init__(
        self, model: nn.Module, encoder: Encoder | None, group: mx.distributed.Group | None, deepstack: int = 0
    ) -> None:
        self.embed = backbone(model).embed_tokens
        self.encoder = encoder
        self.group = group
        self.missing: list[str] = []  # digests rank 0 had no pixels for: zeros fed, the step raised after
        self.layers = deepstack  # early layers that take deepstack features (Qwen3-VL's)
        self.deepstack: tuple[list[int], mx.array] | None = None  # the last chunk's: rows, (layers, rows, hidden)
        self.per_layer = per_layer_inputs(model)

    def tokens(self, tokens: list[int], runs: list[ImageRun]) -> list[int]:
        """The tokens fed beside the chunk's embeddings: an image's positions hold token 0 where the model reads
        per-layer inputs from the tokens, as mlx-vlm's gemma4 reads them."""
        if not self.per_layer:
            return tokens
        out = list(tokens)
        for run in runs:
            out[run.at : run.at + run.count] = [0] * run.count
        return out

    def embeddings(self, tokens: list[int], runs: list[ImageRun], pixels: Mapping[str, images.Inputs]) -> mx.array:
        """The chunk's input embeddings, (1, tokens, hidden), the image runs' positions holding their features
        (rank 0 encodes them from ``pixels``, the step's inputs by digest)."""
        embedded = self.embed(mx.array(tokens)[None])
        hidden, dtype = embedded.shape[-1], embedded.dtype
        rows = sum(run.count for run in runs)
        width = hidden * (1 + self.layers)
        if self.encoder is not None:
            pieces = []
            for run in runs:
                features = self.encoder.of(run.digest, pixels.get(run.digest))
                if features is None:
                    self.missing.append(run.digest)
                    features = mx.zeros((run.first + run.count, width), dtype)
                pieces.append(features[run.first : run.first + run.count].astype(dtype))
            features = mx.concatenate(pieces)
        else:
            features = mx.zeros((rows, width), dtype)
        if self.group is not None and self.group.size() > 1:
            # Evaluated now: a pipeline stage's graph would hold this sum beside its receive from the stage
            # before, in no fixed order, while the stage before sums first and sends after.
            features = mx.distributed.all_sum(features, group=self.group)
            mx.eval(features)
        places = [run.at + k for run in runs for k in range(run.count)]
        if self.layers:
            deep = features[:, hidden:].reshape(rows, self.layers, hidden).transpose(1, 0, 2)
            self.deepstack = (places, deep)
        row = embedded[0]
        row[mx.array(places)] = features[:, :hidden]
        return row[None]

    def take_missing(self) -> str | None:
        """After a step: why it must be refused, where an image's pixels were gone (zeros were fed in their
        place, so that every rank still issued the same collectives)."""
        if not self.missing:
            return None
        gone, self.missing = self.missing, []
        return (
            f"the step that fed image {gone[0][:12]} carried none of its pixels (a bug upstream: each step carries "
            "the inputs of the images it feeds); send the request again"
        )


def per_layer_inputs(model: nn.Module) -> bool:
    """Whether every layer takes an input of its own computed from the tokens and the input embeddings
    (gemma4's ``hidden_size_per_layer_input``)."""
    return bool(getattr(backbone(model), "hidden_size_per_layer_input", 0))


# Architectures whose mlx-lm language model multiplies its input embeddings by a scale that mlx-vlm's applies
# before it puts an image's features in (to the text's embeddings alone): the features are divided by it first.
SCALED_AFTER = frozenset({"gemma4"})


def attach(
    model_path: str,
    config: dict[str, Any],
    model: nn.Module,
    rank: int,
    group: mx.distributed.Group | None,
    staged: bool,
) -> Images | None:
    """The rank's ``Images`` for a vision-language model (None for a text-only one, and on a pipeline stage after
    the first unless its layers take per-layer inputs: it never embeds)."""
    every_stage = staged and per_layer_inputs(model)
    if "vision_config" not in config or (staged and rank != 0 and not every_stage):
        return None
    encoder = None
    if rank == 0:
        inner = backbone(model)
        scale = float(inner.embed_scale) if config.get("model_type") in SCALED_AFTER else 1.0
        encoder = Encoder(model_path, inner.embed_tokens, scale)
    return Images(model, encoder, None if staged and not every_stage else group, mrope.deepstack_layers(config))
