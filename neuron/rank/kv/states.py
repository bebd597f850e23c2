"""Linear-attention states that drop a rejected draft: speculation on Qwen3-Next and Qwen3.5's gated delta nets.

A gated delta layer keeps two arrays per row (mlx-lm's ``ArraysCache``): the last ``kernel - 1`` inputs of its
convolution and one recurrent state for the whole past. Neither can be cut back to an earlier length, so a
verify step that feeds ``[token] + draft`` must keep what each layer held after every position it fed: the step
after names how many tokens each row drops (``Decode.drop``), and each row takes back the state of the last
position it kept. vLLM keeps per-position states for its Mamba speculation in the same way; undoing instead
(copy, restore, feed the kept tokens again) costs a second forward (BENCHMARKS.md, "Speculation where caches
cannot be cut").

Where the states come from, without a copy of mlx-lm's layer code: the batched caches of decoding rows are
``Recording`` caches, recording (``record_each_position``) while a step that feeds several positions is built, and
the layer's first read of a recording cache marks it as the one being run. Two hooks then see what mlx-lm's call
computes: the convolution (its module's class swapped for ``_RecordingConv1d``) keeps its whole input, whose windows
are every position's convolution state; and ``gated_delta_update`` (replaced in the model's module, a pass-through
elsewhere) runs the recurrence one position at a time for a step that feeds several, keeping each position's state.
Where mlx-lm runs no Metal kernel (the CPU, CUDA) its recurrence is that same loop, so the states and the outputs
are the ones it computes; on a Mac's GPU its kernel runs once per position there. MLX arrays are values: keeping
them costs no copy, only their memory until the next step (the verify's width times a state per layer and row).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

_running = threading.local()  # the Recording cache whose layer runs now, on this thread (each rank's own)


class Recording(ArraysCache):
    """A batch of rows' gated-delta caches that keeps each position's state of the last step that fed several."""

    def __init__(self, size: int, left_padding: list[int] | None = None) -> None:
        super().__init__(size, left_padding)
        self.inputs: mx.array | None = None  # (rows, kernel - 1 + width, channels): the convolution's whole input
        # The state after each position, (rows, heads, value dim, key dim) each: apart, so that taking a row's back
        # copies that row's alone
        self.states: list[mx.array] | None = None
        self.recording = False

    def __getitem__(self, idx: int) -> Any:
        if idx == 0 and self.recording:  # the layer's first read: the hooks record into this cache until it advances
            _running.cache = self
        return super().__getitem__(idx)

    def advance(self, N: int) -> None:
        _running.cache = None
        super().advance(N)

    def filter(self, batch_indices: Any) -> None:
        super().filter(batch_indices)
        if self.inputs is not None and self.states is not None:
            self.inputs = self.inputs[batch_indices]
            self.states = [state[batch_indices] for state in self.states]

    def extend(self, other: ArraysCache) -> None:
        """Rows join (their prompts done, nothing to drop): their records are their states as they are."""
        records = self.inputs, self.states
        super().extend(other)
        inputs, states = records
        if inputs is None or states is None or other[0] is None or other[1] is None:
            self.inputs = self.states = None
            return
        width = len(states)
        joining = other[0].shape[0]
        padded = mx.concatenate([mx.zeros((joining, width, inputs.shape[2]), inputs.dtype), other[0]], axis=1)
        self.inputs = mx.concatenate([inputs, padded])
        self.states = [mx.concatenate([state, other[1].astype(state.dtype)]) for state in states]

    def drop(self, drops: list[int]) -> None:
        """Row i takes back what it held before its last ``drops[i]`` positions of the last step."""
        if not any(drops):
            return
        if self.inputs is None or self.states is None:
            raise ValueError(
                "a linear-attention layer's cache cannot drop tokens: the step that fed them kept no states per "
                "position (a step of one token each); clear_kv_cache to resynchronize"
            )
        width = len(self.states)
        self[1] = mx.stack([self.states[width - 1 - drop][row] for row, drop in enumerate(drops)])
        kept = width - mx.array(drops)
        window = self[0].shape[1]
        positions = kept[:, None] + mx.arange(window)
        self[0] = mx.take_along_axis(self.inputs, positions[..., None], axis=1)
        self.inputs = self.states = None


class _RecordingConv1d(nn.Conv1d):
    """A gated delta layer's convolution, which gives the cache being run its whole input."""

    def __call__(self, x: mx.array) -> mx.array:
        cache = getattr(_running, "cache", None)
        if cache is not None:
            cache.inputs = x
        return super().__call__(x)


def record_each_position(cache: list[Any], several: bool) -> None:
    """Before a batch's forward is built: its gated delta layers record each position's state where it feeds
    ``several`` positions per row; else they forget what they recorded (nothing of that step can be dropped)."""
    _running.cache = None
    for layer in cache:
        if isinstance(layer, Recording):
            layer.recording = several
            if not several:
                layer.inputs = layer.states = None


def stop_recording(cache: list[Any]) -> None:
    """Once the forward is built: what it recorded stays for the next step's drops, and nothing records more."""
    _running.cache = None
    for layer in cache:
        if isinstance(layer, Recording):
            layer.recording = False


def _recording(update: Any) -> Any:
    def gated_delta_update(  # mlx-lm's signature
        q: mx.array,
        k: mx.array,
        v: mx.array,
        a: mx.array,
        b: mx.array,
        A_log: mx.array,
        dt_bias: mx.array,
        state: mx.array | None = None,
        mask: mx.array | None = None,
        **kw: Any,
    ) -> tuple[mx.array, mx.array]:
        cache = getattr(_running, "cache", None)
        width = q.shape[1]
        if cache is None or width == 1:
            return update(q, k, v, a, b, A_log, dt_bias, state, mask, **kw)
        ys, states = [], list[mx.array]()
        for t in range(width):
            one = slice(t, t + 1)
            at = None if mask is None else mask[:, one]
            y, state = update(q[:, one], k[:, one], v[:, one], a[:, one], b[:, one], A_log, dt_bias, state, at, **kw)
            ys.append(y)
            states.append(state)
        cache.states = states
        return mx.concatenate(ys, axis=1), states[-1]

    gated_delta_update.recording = True  # type: ignore[attr-defined]
    return gated_delta_update


def hook(model: nn.Module) -> int:
    """Let ``model``'s gated delta layers record per position into ``Recording`` caches; returns how many."""
    hooked = 0
    for _, module in model.named_modules():
        conv = module.get("conv1d") if isinstance(module, nn.Module) else None
        owner = sys.modules.get(type(module).__module__)
        if not isinstance(conv, nn.Conv1d) or owner is None or not hasattr(owner, "gated_delta_update"):
            continue
        update = getattr(owner, "gated_delta_update")  # noqa: B009 - mypy does not know the module
        if not getattr(update, "recording", False):
            setattr(owner, "gated_delta_update", _recording(update))  # noqa: B010
        conv.__class__ = _RecordingConv1d
        hooked += 1
    return hooked
