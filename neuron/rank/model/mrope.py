"""Multimodal rotary positions (M-RoPE, Qwen3-VL's) and deepstack features on a rank.

A Qwen3-VL prompt with an image gives each token three positions (time, row, column): text tokens the same one
thrice, an image's tokens their place in its grid, and every token after an image a position smaller than its
index (an image of h x w tokens advances the positions by max(h, w) only). Where all three are equal M-RoPE is
the plain rotary embedding, so mlx-lm serves these models' text as qwen3 with its own rotary module: this wraps
that module, and only where the plan gives positions does it compute the rotation from them (mlx-vlm's
frequencies). The plan gives them (``rpc.Prefill.positions``) for every chunk of a prompt whose positions are not
the plain ones; a decode row's ``rope_delta`` is how far its positions lag its cache's length. The scheduler
computes them (``engine.image_prompts``); every rank, every stage, reads the same plan.

Both are read where the rotary module is called, by the cache's offset (the tokens before this forward): a chunk
fed in several forwards (``runner.FORWARD_TOKENS``, or its last token alone) takes each forward's slice.

Deepstack: Qwen3-VL's vision tower also gives each image token a feature for each of the language model's first
layers, added to that layer's output. Rank 0 computes them with the image's features (``rank.model.vision``); they
reach the ranks that need them in the same sum.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from neuron.rank.failures import RankError
from neuron.rank.model.parts import backbone


class Positions:
    """The positions the rotary modules of one rank's layers apply in the forward being built."""

    def __init__(self, dims: int, base: float, section: list[int]) -> None:
        from mlx_vlm.models.rope_utils import MRoPERotaryEmbedding

        self.rotary = MRoPERotaryEmbedding(dims, base=base, mrope_section=section, style="interleaved")
        self.start = 0  # the cache offset at which ``placed`` starts
        self.placed: mx.array | None = None  # (3, 1, tokens): a prompt chunk's positions
        self.shift: mx.array | None = None  # (rows,): each decode row's lag behind its cache's length
        self.deepstack: tuple[list[int], mx.array] | None = None  # chunk-relative rows, (layers, rows, hidden)

    @contextmanager
    def chunk(
        self, start: int, positions: Sequence[Sequence[int]], deepstack: tuple[list[int], mx.array] | None = None
    ) -> Iterator[None]:
        """A prompt chunk fed at cache offset ``start``: its tokens' three rows of positions (none: the plain
        ones), and the deepstack features of its image tokens."""
        self.start = start
        self.placed = mx.array([list(row) for row in positions], dtype=mx.int32)[:, None, :] if positions else None
        self.deepstack = deepstack
        try:
            yield
        finally:
            self.placed, self.deepstack = None, None

    @contextmanager
    def shifted(self, deltas: Sequence[int] | None) -> Iterator[None]:
        """Decode rows whose positions lag their caches' lengths by ``deltas`` (None or all zero: none lag)."""
        self.shift = mx.array(list(deltas), dtype=mx.int32) if deltas and any(deltas) else None
        try:
            yield
        finally:
            self.shift = None

    def rotate(self, inner: nn.Module, x: mx.array, offset: Any) -> mx.array:
        at = offset - self.start if isinstance(offset, int) else -1
        # Outside the chunk's positions only in a shadow step (fresh caches, its numbers thrown away).
        if self.placed is not None and 0 <= at <= self.placed.shape[-1] - x.shape[-2]:
            cos, sin = self.rotary(x, self.placed[:, :, at : at + x.shape[-2]])
            return _rotated(x, cos, sin)
        if self.shift is not None:
            offset = offset + self.shift
        return inner(x, offset=offset)

    def add_deepstack(self, layer: int, hidden: mx.array, offset: Any) -> mx.array:
        if self.deepstack is None or not isinstance(offset, int):
            return hidden
        rows, features = self.deepstack
        if layer >= features.shape[0]:
            return hidden
        at = offset - self.start
        mine = [i for i, row in enumerate(rows) if at <= row < at + hidden.shape[1]]
        if not mine:
            return hidden
        where = mx.array([rows[i] - at for i in mine])
        return hidden[0].at[where].add(features[layer][mx.array(mine)].astype(hidden.dtype))[None]


@contextmanager
def placed(
    positions: Positions | None,
    start: int,
    rows: Sequence[Sequence[int]],
    deepstack: tuple[list[int], mx.array] | None = None,
) -> Iterator[None]:
    """``positions.chunk``, where the model has M-RoPE; nothing otherwise."""
    if positions is None:
        yield
        return
    with positions.chunk(start, rows, deepstack):
        yield


@contextmanager
def shifted(positions: Positions | None, deltas: Sequence[int] | None) -> Iterator[None]:
    """``positions.shifted``, where the model has M-RoPE; nothing otherwise."""
    if positions is None:
        yield
        return
    with positions.shifted(deltas):
        yield


def _rotated(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """mlx-vlm's interleaved M-RoPE on one of the queries or the keys, (rows, heads, tokens, head_dim); the
    rotary dimensions lead, the rest pass unchanged (a partial rotary embedding)."""
    from mlx_vlm.models.rope_utils import rotate_half

    cos, sin = cos[:, None], sin[:, None]
    dims = cos.shape[-1]
    turned = (x[..., :dims] * cos + rotate_half(x[..., :dims]) * sin).astype(x.dtype)
    return turned if dims == x.shape[-1] else mx.concatenate([turned, x[..., dims:]], axis=-1)


class Rope(nn.Module):
    """A layer's rotary module, as the model calls it (``rope(x, offset=...)``), rotating by the plan's
    positions where it gives them (``Positions``)."""

    def __init__(self, inner: nn.Module, positions: Positions) -> None:
        super().__init__()
        self.inner = inner
        self._positions = positions  # ``_``: not a child module, the rank's one shared state

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        return self._positions.rotate(self.inner, x, offset)


_DEEPSTACKED: dict[type, type] = {}


def _deepstacked(layer: nn.Module, index: int, positions: Positions) -> None:
    """Make ``layer`` add its deepstack features after its own call. Its class is swapped for a subclass rather
    than the layer wrapped, so that its parameters keep their names and everything reading them still finds
    them."""
    base = type(layer)
    if base not in _DEEPSTACKED:

        def __call__(self: Any, x: mx.array, mask: Any = None, cache: Any = None, *args: Any, **kw: Any) -> mx.array:
            offset = cache.offset if cache is not None else 0
            out = base.__call__(self, x, mask, cache, *args, **kw)
            return self._positions.add_deepstack(self._deepstack_index, out, offset)

        _DEEPSTACKED[base] = type(f"Deepstacked{base.__name__}", (base,), {"__call__": __call__})
    layer.__class__ = _DEEPSTACKED[base]
    layer._positions = positions
    layer._deepstack_index = index


def mrope_section(config: dict[str, Any]) -> list[int] | None:
    """The model's M-RoPE sections (time, row, column), where its language model uses M-RoPE."""
    text = config.get("text_config", config)
    scaling = text.get("rope_scaling") or text.get("rope_parameters") or {}
    section = scaling.get("mrope_section")
    return list(section) if section and "vision_config" in config else None


def deepstack_layers(config: dict[str, Any]) -> int:
    """How many of the language model's first layers take deepstack features (Qwen3-VL's)."""
    return len(config.get("vision_config", {}).get("deepstack_visual_indexes") or [])


def attach(config: dict[str, Any], model: nn.Module, rank: int, first_layer: int = 0) -> Positions | None:
    """Wrap the rotary module of every attention layer this rank holds, and make the first layers add deepstack
    features (those of them this rank holds: ``first_layer`` is its stage's first). None where the model has no
    M-RoPE."""
    section = mrope_section(config)
    if section is None:
        return None
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        raise RankError(
            f"rank {rank} ({socket.gethostname()}): {config.get('model_type')!r} rotates by mlx-vlm's multimodal "
            "positions on every rank: pip install 'neuron[vision]' on every host"
        ) from None
    layers = backbone(model).layers
    attentions = [a for layer in layers if (a := _attention(layer)) is not None]
    if not attentions:
        return None
    rope = attentions[0].rope
    dims = int(getattr(rope, "dims", 0) or getattr(rope, "_dims", 0))
    base = float(getattr(rope, "base", 0) or config.get("text_config", config).get("rope_theta", 10000.0))
    deep = deepstack_layers(config)
    if 0 < first_layer < deep:
        raise RankError(
            f"rank {rank}: the first {deep} layers take the images' deepstack features, which only the first "
            f"pipeline stage has, and this stage starts at layer {first_layer}: serve it with fewer --pp stages, "
            "or with --tp"
        )
    positions = Positions(dims, base, section)
    for attention in attentions:
        attention.rope = Rope(attention.rope, positions)
    for index, layer in enumerate(layers):
        if first_layer + index < deep:
            _deepstacked(layer, first_layer + index, positions)
    return positions


def _attention(layer: nn.Module) -> nn.Module | None:
    attention = layer.get("self_attn") if isinstance(layer, dict) else getattr(layer, "self_attn", None)
    return attention if attention is not None and "rope" in attention else None
