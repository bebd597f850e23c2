"""How one rank runs a forward pass, and where its hidden states and logits go.

``Sliced`` is tensor parallelism: every rank holds a slice of every layer, and
the all-reduces ``shard()`` put in each layer join the slices. ``Stage`` is
pipeline parallelism: every rank holds a run of whole layers, receives the
hidden states of the rank before it, and sends its own to the next; the last
stage sends the positions whose logits are wanted back to rank 0, which holds
the final norm and the projection to the vocabulary, because rank 0 samples.
Both issue the same collectives on every rank for the same call, whatever a
rank's own state: the plan alone fixes every shape.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma4_text import logit_softcap

from neuron.rank.kv import caches
from neuron.rank.model import staged
from neuron.rank.model.lora import Selection
from neuron.rank.model.mrope import shifted
from neuron.rank.model.parts import backbone, head_gathers
from neuron.rank.model.share import VocabSlice

if TYPE_CHECKING:
    from neuron.rank.model.mrope import Positions
    from neuron.rank.model.vision import Images

# One forward pass takes at most this many tokens of a prompt (however many the
# step feeds): the attention scores of one pass stay small, and every rank cuts
# a prompt at the same places, so all ranks issue the same collectives in the
# same order.
FORWARD_TOKENS = 512

Cache = Sequence[caches.Layer]  # one sequence's, or a batch's
Pass = tuple[mx.array, Cache]  # tokens (rows of equal length) and the caches they extend
Lags = Sequence[Sequence[int]] | None  # each pass's rows' M-RoPE position deltas (``rank.model.mrope``)
Adapters = Sequence[int] | None  # each row's LoRA adapter (0: the base), for ``Selection.use``; None: the base's


def _eval_with(cache: Cache, *arrays: mx.array) -> None:
    mx.eval(*arrays, [caches.arrays(c) for c in cache])


class Sliced:
    """Tensor parallel: a slice of every layer here; the vocabulary projection split too where that pays."""

    images: Images | None = None  # a vision-language model's images, where this rank embeds them
    rope: Positions | None = None  # a model with multimodal rotary positions (Qwen3-VL's): the plan's positions

    def __init__(self, model: nn.Module, head: VocabSlice | None, rank: int) -> None:
        self.model = model
        self.head = head
        self.rank = rank
        # Rank 0 keeps the final hidden states of the positions it gets logits for, one array per pass of the last
        # ``logits`` call, (rows, positions, hidden): the model's own prediction layers draft from them (rank.mtp).
        self.keep_states = False
        self.kept_states: list[mx.array] = []
        # And those of every position the last ``feed`` fed, (rows, positions, hidden): a prompt's, which the
        # prediction layer attends over too. Its layers computed them anyway: keeping them costs their memory only.
        self.fed_states: mx.array | None = None
        self.selection = Selection()  # the LoRA adapters of the forward being built (``rank.model.lora``)
        # What ranks other than 0 run for logits they do not use: the backbone, unless mlx-lm's shard() split the
        # head itself (qwen3_5's gathers its rows inside the model's call, a collective every rank must join).
        self.worker_trunk = model if head_gathers(model) else backbone(model)

    def feed(
        self, tokens: mx.array, cache: Cache, embeddings: mx.array | None = None, adapters: Adapters = None
    ) -> None:
        """Run the layers over ``tokens``, FORWARD_TOKENS at a time, filling ``cache``; no logits. ``embeddings``:
        the tokens' input embeddings, where images replace some (``rank.model.vision``); ``adapters``: each row's."""
        _select(self.selection, adapters)
        trunk, kept = backbone(self.model), []
        for start in range(0, tokens.shape[1], FORWARD_TOKENS):
            piece = slice(start, start + FORWARD_TOKENS)
            if embeddings is None:
                hidden = trunk(tokens[:, piece], cache=cache)
            else:
                hidden = trunk(tokens[:, piece], cache=cache, input_embeddings=embeddings[:, piece])
            _eval_with(cache, hidden)
            if self.keep_states and self.rank == 0:
                kept.append(hidden)
        self.fed_states = mx.concatenate(kept, axis=1) if kept else None

    def scores(self, tokens: mx.array, cache: Cache, adapters: Adapters = None) -> mx.array | None:
        """Like ``feed`` (one row), and rank 0 gets every position's logits, (positions, vocab): prompt scoring."""
        _select(self.selection, adapters)
        trunk, out = backbone(self.model), []
        for start in range(0, tokens.shape[1], FORWARD_TOKENS):
            piece = tokens[:, start : start + FORWARD_TOKENS]
            if self.head is not None:  # every rank projects onto its rows of the vocabulary
                logits = self.head(trunk(piece, cache=cache)[0])
            elif self.rank == 0:
                logits = self.model(piece, cache=cache)[0]
            else:
                _eval_with(cache, self.worker_trunk(piece, cache=cache))
                continue
            _eval_with(cache, logits)
            out.append(logits)
        return mx.concatenate(out) if self.rank == 0 else None

    def states(self, tokens: mx.array, cache: Cache, every: bool) -> mx.array | None:
        """Like ``feed``, and rank 0 gets the final hidden states (the final norm's output, whole on every rank
        once each layer's all-reduce has joined the slices): every position's, (rows, positions, hidden), or with
        ``every`` false the last one's, (rows, 1, hidden). Embeddings are pooled from them; no head runs."""
        _select(self.selection, None)  # the base model's: no adapter serves embeddings
        trunk, out = backbone(self.model), []
        length = tokens.shape[1]
        for start in range(0, length, FORWARD_TOKENS):
            hidden = trunk(tokens[:, start : start + FORWARD_TOKENS], cache=cache)
            if self.rank == 0 and (every or start + FORWARD_TOKENS >= length):
                hidden = hidden if every else hidden[:, -1:, :]
                out.append(hidden)
            _eval_with(cache, hidden)
        return mx.concatenate(out, axis=1) if self.rank == 0 else None

    def logits(
        self,
        passes: Sequence[Pass],
        every: bool = False,
        lazy: bool = False,
        lags: Lags = None,
        adapters: Sequence[Adapters] | None = None,
    ) -> list[mx.array | None]:
        """Each pass's last-position logits on rank 0 (None on the other ranks); with ``every``, those of every
        position, (rows, positions, vocab): speculation verifies a whole draft at once. ``lazy``: nothing waits
        for the device; rank 0's logits come back unevaluated, for whoever reads them, and the other ranks' share
        is queued (``mx.async_eval``), so that its collectives run as soon as rank 0's do. ``lags``: each pass's
        rows' M-RoPE position deltas (``rank.model.mrope``); ``adapters``: each pass's rows' adapters."""
        every_pass = adapters or [None] * len(passes)
        out = []
        self.kept_states = []
        for i, ((tokens, cache), rows) in enumerate(zip(passes, every_pass, strict=True)):
            with _shifted(self.rope, lags[i] if lags else None):
                out.append(self._logits(tokens, cache, every, lazy, rows))
        return out

    def _logits(self, tokens: mx.array, cache: Cache, every: bool, lazy: bool, adapters: Adapters) -> mx.array | None:
        _select(self.selection, adapters)
        wanted = slice(None) if every else -1
        if self.head is not None:  # every rank projects onto its rows of the vocabulary
            hidden = backbone(self.model)(tokens, cache=cache)[:, wanted, :]
            if every:  # the head takes (rows, hidden): one row per position
                rows, width, _ = hidden.shape
                logits = self.head(hidden.reshape(rows * width, -1)).reshape(rows, width, -1)
            else:
                logits = self.head(hidden)
            if self.keep_states and self.rank == 0:
                self.kept_states.append(hidden if every else hidden[:, None])
        elif self.rank == 0 and self.keep_states:  # the head applied as the model's call applies it (rank.mtp)
            hidden = backbone(self.model)(tokens, cache=cache)[:, wanted, :]
            logits = self.model.lm_head(hidden)
            self.kept_states.append(hidden if every else hidden[:, None])
        elif self.rank == 0:
            logits = self.model(tokens, cache=cache)[:, wanted, :]
        else:  # the whole head is rank 0's alone
            logits = self.worker_trunk(tokens, cache=cache)
        if self.rank == 0:
            if not lazy:
                mx.eval(logits)
            return logits
        (mx.async_eval if lazy else mx.eval)(logits)
        return None


def _scaled(project: Callable[[mx.array], mx.array], scaling: float, hidden: mx.array) -> mx.array:
    return project(hidden) / scaling


def _capped(project: Callable[[mx.array], mx.array], cap: float, hidden: mx.array) -> mx.array:
    return logit_softcap(cap, project(hidden))  # mlx-lm's own, compiled as the model's call runs it


class _Received(nn.Module):
    """The embedding of a stage after the first, where the model's own code takes no ``input_embeddings``: it
    gives the hidden states received from the stage before, whatever the tokens, so the model's call runs its
    layers (its masks, its layer calls) as it would on one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[mx.array] = []

    def __call__(self, tokens: mx.array) -> mx.array:
        return self.received.pop()


class Stage:
    """Pipeline parallel: layers ``[first, end)`` of the model here, whole; rank 0 also embeds and projects.

    ``model`` was loaded with only this stage's layers (``share.load_stage``).
    Its inner model's own call runs them, embedding first on rank 0 and taking
    the received hidden states elsewhere (mlx-lm's ``input_embeddings``), with
    its final norm taken out: rank 0 applies it once, after the last stage.
    """

    images: Images | None = None  # a vision-language model's images: the first stage's alone
    rope: Positions | None = None  # a model with multimodal rotary positions: on every stage

    def __init__(self, model: nn.Module, rank: int, stages: int, group: mx.distributed.Group) -> None:
        # Rank 0 keeps the final hidden states it receives from the last stage (the final norm's output), as
        # ``Sliced`` keeps them, where the model's own prediction layers draft (rank.mtp).
        self.keep_states = False
        self.kept_states: list[mx.array] = []
        self.fed_states: mx.array | None = None  # never: the last stage sends back only what rank 0 projects
        self.inner = backbone(model)
        self.rank = rank
        self.stages = stages
        self.group = group
        self.selection = Selection()  # the LoRA adapters of the forward being built (``rank.model.lora``)
        first = self.inner.layers[0]
        norm = first.input_layernorm if "input_layernorm" in first else first.post_attention_layernorm  # olmo2
        self.dtype, self.hidden = norm.weight.dtype, norm.weight.shape[0]
        self.norm: nn.Module | None = None
        self.project: Callable[[mx.array], mx.array] | None = None
        if rank == 0:
            self.norm = self.inner.norm
            head = model.get("language_model", model).get("lm_head")  # qwen3_5's is its language model's
            self.project = head if head is not None else self.inner.embed_tokens.as_linear
            if scaling := getattr(model, "logits_scaling", None):  # granite divides its logits, after the head
                self.project = partial(_scaled, self.project, scaling)
            language = model.get("language_model", model)  # a vision-language model's (gemma4's)
            if cap := getattr(language, "final_logit_softcapping", None):  # gemma4 caps its logits, after the head
                self.project = partial(_capped, self.project, cap)
        self.inner.norm = nn.Identity()
        self.own_call = staged.own_call(model, self.inner)  # where the model's own call cannot run a stage
        self.takes_embeddings = "input_embeddings" in inspect.signature(self.inner.__call__).parameters
        if rank != 0 and not self.takes_embeddings:
            self.inner.embed_tokens = _Received()
            if hasattr(self.inner, "embedding_multiplier"):  # granite scales its embedding: rank 0 did, once
                self.inner.embedding_multiplier = 1.0

    @property
    def last(self) -> bool:
        return self.rank == self.stages - 1

    def _through(self, tokens: mx.array, cache: Cache, embeddings: mx.array | None = None) -> mx.array:
        """This stage's layers over ``tokens``: embedded here on rank 0 (``embeddings`` where images replace some),
        received from the stage before elsewhere."""
        if self.rank == 0 and embeddings is not None:
            if self.own_call is not None:
                return self.own_call(self.inner, tokens, cache, None, embeddings)
            return self.inner(tokens, cache=cache, input_embeddings=embeddings)
        if self.rank == 0:
            return (
                self.inner(tokens, cache=cache)
                if self.own_call is None
                else self.own_call(self.inner, tokens, cache, None)
            )
        rows, length = tokens.shape
        received = mx.distributed.recv((rows, length, self.hidden), self.dtype, self.rank - 1, group=self.group)
        if self.own_call is not None:
            return self.own_call(self.inner, tokens, cache, received, embeddings)
        if self.takes_embeddings:
            return self.inner(tokens, cache=cache, input_embeddings=received)
        self.inner.embed_tokens.received.append(received)
        return self.inner(tokens, cache=cache)

    def feed(
        self, tokens: mx.array, cache: Cache, embeddings: mx.array | None = None, adapters: Adapters = None
    ) -> None:
        _select(self.selection, adapters)
        for start in range(0, tokens.shape[1], FORWARD_TOKENS):
            piece = slice(start, start + FORWARD_TOKENS)
            hidden = self._through(tokens[:, piece], cache, None if embeddings is None else embeddings[:, piece])
            if not self.last:
                hidden = mx.distributed.send(hidden, self.rank + 1, group=self.group)
            _eval_with(cache, hidden)

    def scores(self, tokens: mx.array, cache: Cache, adapters: Adapters = None) -> mx.array | None:
        """Like ``feed`` (one row), and the last stage sends every position back: rank 0 gets their logits."""
        _select(self.selection, adapters)
        out = []
        for start in range(0, tokens.shape[1], FORWARD_TOKENS):
            piece = tokens[:, start : start + FORWARD_TOKENS]
            hidden = self._through(piece, cache)
            _eval_with(cache, mx.distributed.send(hidden, (self.rank + 1) % self.stages, group=self.group))
            if self.rank == 0:
                assert self.norm is not None and self.project is not None
                shape = (1, piece.shape[1], self.hidden)
                hidden = mx.distributed.recv(shape, self.dtype, self.stages - 1, group=self.group)
                out.append(self.project(self.norm(hidden))[0])
                mx.eval(out[-1])
        return mx.concatenate(out) if self.rank == 0 else None

    def states(self, tokens: mx.array, cache: Cache, every: bool) -> mx.array | None:
        """Like ``feed``, and the last stage sends the final hidden states back, of every position or (``every``
        false) of the last: rank 0 applies the final norm and gets them, as ``Sliced.states`` gives them."""
        _select(self.selection, None)
        out = []
        length = tokens.shape[1]
        for start in range(0, length, FORWARD_TOKENS):
            piece = tokens[:, start : start + FORWARD_TOKENS]
            wanted = every or start + FORWARD_TOKENS >= length
            hidden = self._through(piece, cache)
            if not self.last:
                hidden = mx.distributed.send(hidden, self.rank + 1, group=self.group)
            elif wanted:
                hidden = mx.distributed.send(hidden if every else hidden[:, -1:, :], 0, group=self.group)
            _eval_with(cache, hidden)
            if self.rank == 0 and wanted:
                assert self.norm is not None
                shape = (piece.shape[0], piece.shape[1] if every else 1, self.hidden)
                out.append(self.norm(mx.distributed.recv(shape, self.dtype, self.stages - 1, group=self.group)))
                mx.eval(out[-1])
        return mx.concatenate(out, axis=1) if self.rank == 0 else None

    def logits(
        self,
        passes: Sequence[Pass],
        every: bool = False,
        lazy: bool = False,
        lags: Lags = None,
        adapters: Sequence[Adapters] | None = None,
    ) -> list[mx.array | None]:
        """Every pass through every stage; rank 0 gets each pass's last-position logits (``every``: all of them).
        Always evaluated (``lazy`` is for one rank alone): the passes cross ranks. ``adapters``: each pass's rows'.

        Each stage sends a pass on as soon as it is done with it, and rank 0 reads
        the results back only after sending every pass: with several passes (the
        plan's micro-batches), stage 1 works on the first while rank 0 works on
        the second, instead of each stage waiting for the whole batch.
        """
        for i, ((tokens, cache), rows) in enumerate(zip(passes, adapters or [None] * len(passes), strict=True)):
            _select(self.selection, rows)
            with _shifted(self.rope, lags[i] if lags else None):
                hidden = self._through(tokens, cache)
            if self.last:
                sent = mx.distributed.send(hidden if every else hidden[:, -1:, :], 0, group=self.group)
            else:
                sent = mx.distributed.send(hidden, self.rank + 1, group=self.group)
            _eval_with(cache, sent)
        if self.rank != 0:
            return [None] * len(passes)
        assert self.norm is not None and self.project is not None
        out: list[mx.array | None] = []
        self.kept_states = []
        for tokens, _ in passes:
            width = tokens.shape[1] if every else 1
            hidden = mx.distributed.recv(
                (tokens.shape[0], width, self.hidden), self.dtype, self.stages - 1, group=self.group
            )
            hidden = self.norm(hidden)
            if self.keep_states:
                self.kept_states.append(hidden)
            logits = self.project(hidden)
            logits = logits if every else logits[:, -1, :]
            mx.eval(logits)
            out.append(logits)
        return out


def _select(selection: Selection, adapters: Adapters) -> None:
    """The forward's LoRA adapters; nothing to do (the adapters' layers untouched) where none was used nor is."""
    if selection.active or (adapters and any(adapters)):
        selection.use(adapters)


def _shifted(rope: Positions | None, lags: Sequence[int] | None) -> AbstractContextManager[None]:
    """``mrope.shifted``, where the model has multimodal rotary positions; nothing to enter otherwise."""
    return shifted(rope, lags) if rope is not None else nullcontext()
