"""One engine over one tiny model, asked what tests/e2e/architectures/test_architectures.py compares with mlx-lm.

At one rank this runs in the test's own process; a group of ranks needs a leader
process of its own (MLX joins one group per process), so it also runs as
``python -m testkit.arch_checks WORLD_SIZE STAGES MODEL[=LAYERS_PER_STAGE]...`` from the repository's root, serving
each model in turn with fresh workers and printing one JSON line per model.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import anyio

# Lengths around the prefill chunk (16) and the windows (8); the repeated pattern gives prompt lookup drafts.
PROMPTS = [
    [5, 17, 99, 42, 7],
    [11 + i % 7 for i in range(21)],
    [40 + (i * 13) % 50 for i in range(37)],
    [200, 201, 202, 203, 200, 201, 202, 203, 200, 201, 202, 203],
]
EXTENDED = PROMPTS[2] + [9, 8, 7, 6, 5]  # shares PROMPTS[2]'s whole prompt: a prefix-cache hit where it is on
NEXT_TURN = [7, 8, 9]  # a chat's next turn: the last prompt, its reply, and this
MAX_TOKENS = 12
PREFILL_CHUNK = 16


def reference(model_path: str) -> dict[str, list[list[int]]]:
    """mlx-lm's own greedy tokens for every prompt, on the same weights."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_path))

    def greedy(prompt: list[int]) -> list[int]:
        steps = generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)
        return [int(token) for token, _ in steps]

    prompts = [greedy(p) for p in PROMPTS]
    return {"prompts": prompts, "extended": greedy(EXTENDED), "next_turn": greedy(_next_turn(prompts[3]))}


def _next_turn(reply: list[int]) -> list[int]:
    return PROMPTS[3] + reply + NEXT_TURN


def _counted(name: str) -> float:
    """A counter's value as /metrics shows it."""
    from neuron.metrics import REGISTRY

    return REGISTRY.get_sample_value(f"{name}_total") or 0.0


async def _tokens(
    engine: Any, prompt: list[int], n: int = 1, predicted: list[int] | None = None
) -> tuple[list[list[int]], dict[str, int]]:
    """The tokens of each choice, and how the last ended: tokens restored from the prefix cache, tokens drafted.
    ``predicted``: the output's prediction, as token ids (a random model's tokens do not survive a round trip
    through text, as a request's ``prediction`` takes), where the engine drafts."""
    from neuron.engine.sequence import Chunk, Failure, Finish
    from neuron.sampling_params import SamplingParams

    seq = engine.submit(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), n=n)
    if predicted and seq.proposer is not None:  # before the step loop runs again: nothing awaited since submit
        seq.proposer.prediction = predicted
    out, finish = [], {}
    for one in [seq, *seq.copies]:
        tokens = []
        try:
            async for event in one.events:
                if isinstance(event, Failure):
                    raise RuntimeError(event.message)
                if isinstance(event, Chunk):
                    tokens.append(event.token)
                if isinstance(event, Finish):
                    finish = {"cached": event.cached_tokens, "drafted": event.accepted_tokens + event.rejected_tokens}
        finally:
            engine.cancel(one)
        out.append(tokens)
    return out, finish


async def serve(model_path: str, world_size: int = 1, stages: int = 1, split: str = "") -> dict[str, Any]:
    """Each prompt alone, then all together, then two choices of one, then a prompt extending a served one."""
    from neuron.engine.engine import Engine
    from neuron.engine.scheduler import Scheduling
    from neuron.pool import Layout

    asked = Scheduling(prefill_chunk=PREFILL_CHUNK, prefix_cache_bytes=1 << 24, micro_batches=stages)
    result: dict[str, Any] = {}
    async with Engine.open(
        Path(model_path), Layout.local(world_size, stages, tuple(int(n) for n in split.split(",") if n)), limits=asked
    ) as engine:
        result["speculate"] = engine.limits.speculate
        proposed = _counted("neuron_speculative_proposed_tokens")
        if os.environ.get("NEURON_TEST_DESYNC_STEP"):  # a rank goes its own way during the first request
            try:
                await _tokens(engine, PROMPTS[1])
                result["desync"] = ""
            except RuntimeError as e:
                result["desync"] = str(e)
        alone = [(await _tokens(engine, p))[0][0] for p in PROMPTS]
        result["alone"] = alone
        together: list[list[int]] = [[] for _ in PROMPTS]
        drafted = [0] * len(PROMPTS)
        # Together, each predicted by its own reply alone: right throughout for some (whole drafts kept), wrong from
        # the sixth token for the others (the rest of each draft rejected and dropped from the caches).
        predictions = [out if i % 2 else [*out[:5], (out[5] + 1) % 250, *out[6:]] for i, out in enumerate(alone)]

        async def one(i: int) -> None:
            tokens, finish = await _tokens(engine, PROMPTS[i], predicted=predictions[i])
            together[i], drafted[i] = tokens[0], finish["drafted"]

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
        result["together"] = together
        result["drafted"] = sum(drafted)
        result["proposed"] = _counted("neuron_speculative_proposed_tokens") - proposed
        result["copies"] = (await _tokens(engine, PROMPTS[1], n=2))[0]
        hits = _counted("neuron_prefix_cache_hits")
        extended, finish = await _tokens(engine, EXTENDED)
        result["extended"], result["cached"] = extended[0], finish["cached"]
        next_turn, finish = await _tokens(engine, _next_turn(result["alone"][3]))
        result["next_turn"], result["next_turn_cached"] = next_turn[0], finish["cached"]
        result["hits"] = _counted("neuron_prefix_cache_hits") - hits
    return result


def serve_each(world_size: int, stages: int, models: list[str]) -> None:
    """Serve each model in turn from this one leader process, each with fresh workers; one JSON line per model,
    its result or its error. The group is left between models (``rank.dist.group.leave``), as a leader does to form a
    fresh one, so that the leader's own start (its imports) is paid once, not once per model."""
    from neuron.engine.engine import Engine  # noqa: F401 (imported before the freeze below)
    from neuron.rank.dist import group

    # The imports' objects kept out of the collections that every ``group.leave`` runs, as neuron's own command
    # keeps them out of its teardown's.
    gc.freeze()
    for spec in models:
        model, _, split = spec.partition("=")
        try:
            line = {"model": model, "result": anyio.run(serve, model, world_size, stages, split)}
        except Exception:  # noqa: BLE001 (the next model is served all the same: each test reads its own line)
            line = {"model": model, "error": traceback.format_exc()}
        print(json.dumps(line), flush=True)
        group.leave()


if __name__ == "__main__":
    serve_each(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
    gc.freeze()  # as neuron's own command does: the teardown need not trace every object the models left
