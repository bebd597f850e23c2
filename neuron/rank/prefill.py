"""Feeding prompts on one rank: new ones together, long ones chunk by chunk, scored ones with every position's
logits, and ``n`` choices copied from one prompt's cache.

Every call here issues the same collectives on every rank for the same plan (the
grouping depends on the plan alone), and rank 0 gets the logits of each prompt
that ends in this step. The rank's holdings own the state these functions
fill: ``seqs``, one ``SeqState`` per sequence (``rank.kv.sequence``).
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache

from neuron.images import Inputs
from neuron.rank.kv import caches
from neuron.rank.kv.sequence import SeqState
from neuron.rank.model.mrope import placed
from neuron.rank.runner import Sliced, Stage
from neuron.rpc import Prefill


def feed_prompts(
    runner: Sliced | Stage,
    model: nn.Module,
    seqs: dict[int, SeqState],
    chunks: list[Prefill],
    shadow: bool = False,
    together: bool = True,
    pixels: Mapping[str, Inputs] | None = None,
) -> dict[int, mx.array]:
    """Feed prompt chunks; rank 0 returns the next-token logits of each prompt that ends here.

    New prompts (position 0) go through together, left-padded into one batch,
    then each is extracted into a cache of its own; continuing chunks of long
    prompts go one by one, and so do new ones unless ``together`` (false where
    the model has caches that cannot take left padding: a sliding window's or a
    linear-attention state's; decided from the whole model, not this rank's
    stage, so every rank groups alike). The grouping depends on the plan alone,
    so every rank issues the same collectives. ``shadow`` runs the same shapes on
    throwaway caches and records nothing. ``pixels``: rank 0's, the inputs of the
    images the chunks put in (``Step.images``).
    """
    out: dict[int, mx.array] = {}
    fresh = [chunk for chunk in chunks if _batched(chunk, together)]
    if fresh:
        runner.fed_states = None
        logits, batched = _forward_new_prompts(
            runner, caches.fresh(model), [chunk.tokens for chunk in fresh], [chunk.adapter for chunk in fresh]
        )
        for i, chunk in enumerate(fresh):
            if not shadow:
                own = [layer.extract(i) for layer in batched]
                seqs[chunk.seq] = SeqState(len(chunk.tokens), chunk.tokens[-1], own, chunk.last)
                if runner.fed_states is not None and len(chunk.tokens) > 1:  # its body, left-padded in the batch
                    body = chunk.tokens[:-1]
                    seqs[chunk.seq].saw(runner.fed_states[i, -len(body) :], body, 0)
            if chunk.last and logits is not None:
                out[chunk.seq] = logits[i]
                if runner.kept_states and not shadow:
                    seqs[chunk.seq].saw(runner.kept_states[0][i], chunk.tokens[-1:], len(chunk.tokens) - 1)
    for chunk in chunks:
        if _batched(chunk, together):
            continue
        if shadow or chunk.position == 0:
            state = SeqState(cache=caches.fresh(model))
            if not shadow:
                seqs[chunk.seq] = state
        else:
            state = seqs[chunk.seq]
        assert state.cache is not None
        if chunk.scores:  # every position's logits, for rank 0 to score the prompt with
            logits = runner.scores(mx.array(chunk.tokens)[None], state.cache, [chunk.adapter])
        else:
            fed, embeddings, deepstack = chunk.tokens, None, None
            if chunk.images and runner.images:
                embeddings = runner.images.embeddings(chunk.tokens, chunk.images, pixels or {})
                fed = runner.images.tokens(chunk.tokens, chunk.images)
                deepstack, runner.images.deepstack = runner.images.deepstack, None
            runner.fed_states = None
            with placed(runner.rope, chunk.position, chunk.positions, deepstack):
                logits = _forward_prompt(runner, fed, chunk.last, state.cache, embeddings, chunk.adapter)
            if runner.fed_states is not None and not shadow and embeddings is None:  # the chunk's body
                body = chunk.tokens[:-1] if chunk.last else chunk.tokens
                state.saw(runner.fed_states[0], body, state.position)
        state.position += len(chunk.tokens)
        state.last = chunk.tokens[-1]
        state.prompt_done = chunk.last
        if logits is not None:
            out[chunk.seq] = logits
            hidden = runner.kept_states[0][0] if runner.kept_states and not chunk.scores else None
            state.saw(hidden, chunk.tokens[-1:], state.position - 1)
    for chunk in chunks:
        if chunk.copies and not shadow:
            _copy(seqs, chunk.seq, chunk.copies)
            if chunk.seq in out:
                out.update(dict.fromkeys(chunk.copies, out[chunk.seq]))
    return out


def _batched(chunk: Prefill, together: bool) -> bool:
    """Whether a chunk goes with the new prompts fed together: not one with images (fed with its own embeddings)
    or positions of its own."""
    return chunk.position == 0 and not chunk.scores and together and not chunk.images and not chunk.positions


def _copy(seqs: dict[int, SeqState], seq: int, copies: list[int]) -> None:
    """Each copy starts with ``seq``'s cache, its own arrays: a copy's writes must not reach the others."""
    state = seqs[seq]
    assert state.cache is not None
    for no in copies:
        seqs[no] = SeqState(state.position, state.last, caches.copied(state.cache), True)
        seqs[no].seen = list(state.seen)


def _forward_new_prompts(
    runner: Sliced | Stage, fresh: list[caches.Layer], prompts: list[list[int]], adapters: list[int]
) -> tuple[mx.array | None, list[BatchKVCache]]:
    """All but each prompt's last token, left-padded into one batch of caches of ``fresh``'s kinds (a new
    sequence's); then the last tokens together. ``adapters``: each prompt's LoRA adapter."""
    bodies = [tokens[:-1] for tokens in prompts]
    width = max(len(body) for body in bodies)
    batched = caches.padded_batch(fresh, [width - len(body) for body in bodies])
    if width:
        runner.feed(mx.array([[0] * (width - len(body)) + body for body in bodies]), batched, adapters=adapters)
    final = mx.array([tokens[-1:] for tokens in prompts])
    return runner.logits([(final, batched)], adapters=[adapters])[0], batched


def _forward_prompt(
    runner: Sliced | Stage,
    tokens: list[int],
    last: bool,
    cache: list[caches.Layer],
    embeddings: mx.array | None = None,
    adapter: int = 0,
) -> mx.array | None:
    """Feed prompt tokens; when they end the prompt, the last goes through alone, so that the projection
    to the vocabulary is computed for one position only (never an image's: ``engine.image_prompts`` refuses a prompt
    that ends in one)."""
    body = tokens[:-1] if last else tokens
    if body:
        runner.feed(mx.array(body)[None], cache, None if embeddings is None else embeddings[:, : len(body)], [adapter])
    if not last:
        return None
    logits = runner.logits([(mx.array(tokens[-1:])[None], cache)], adapters=[[adapter]])[0]
    return None if logits is None else logits[0]
