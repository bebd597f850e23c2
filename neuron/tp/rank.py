"""One rank's MLX state: its group, its slice of the model, its KV cache.

A worker process drives one ``Rank`` from its main thread; the leader drives
rank 0's from one dedicated thread. MLX streams belong to the thread that made
them, so a ``Rank`` must stay on the thread that created its group and model.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from neuron.tp.model import backbone, check_shardable, load_shard, parameter_count

# Prompts are fed in chunks of this many tokens: the attention scores of one
# chunk stay small, and every rank cuts a prompt at the same places, so all
# ranks issue the same collectives in the same order.
PREFILL_CHUNK = 512

# Test hook: "RANK:N" makes that rank fail its Nth step after the forward, with
# every collective of the step done, as a bug in post-processing would.
FAULT_ENV = "NEURON_TEST_FAIL_STEP"


class RankError(RuntimeError):
    """A step or request refused or failed with the group still in step.

    Raised either before any collective (identically on every rank, since every
    rank checks the same request) or after all of them, so no peer is left
    waiting inside a collective. Any other exception means the group is suspect.
    """


class InjectedFault(RankError):
    pass


# MLX keeps one distributed group per process: a second init returns the first
# group (or a dead one after a failure). A process joins at most once, and a
# new group means a new process.
_joined_group = False


def group_joined() -> bool:
    """Whether this process has already joined a group (and so can never join another)."""
    return _joined_group


@dataclass(slots=True)
class Loaded:
    parameters: int
    seconds: float


class Rank:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group: mx.distributed.Group | None = None
        self.model: nn.Module | None = None
        self.cache: list | None = None
        self.vocab_size = 0
        self._steps = 0
        self._fail_at = self._fault_step()

    def _fault_step(self) -> int | None:
        spec = os.environ.get(FAULT_ENV, "")
        rank, _, step = spec.partition(":")
        return int(step) if spec and int(rank) == self.rank else None

    def init_group(self, backend: str, env: dict[str, str]) -> float:
        """Join the group and return the sanity all-reduce of 1.0 from every rank."""
        if self.world_size == 1:
            return 1.0
        global _joined_group
        if _joined_group:
            raise RankError(
                f"rank {self.rank}: this process already joined an mx.distributed group, and MLX cannot "
                "join another; start a fresh process for a new group"
            )
        os.environ.update(env)
        _joined_group = True
        group = mx.distributed.init(strict=True, backend=backend)
        if group.rank() != self.rank or group.size() != self.world_size:
            raise RankError(
                f"joined the {backend} group as rank {group.rank()} of {group.size()}, "
                f"expected rank {self.rank} of {self.world_size}: check MLX_RANK and the hostfile"
            )
        total = mx.distributed.all_sum(mx.array(1.0), group=group)
        self.group = group
        return float(total.item())

    def load(self, model_path: str) -> Loaded:
        if self.world_size > 1 and self.group is None:
            raise RankError(f"rank {self.rank}: load_shard before init; send init first")
        start = time.perf_counter()
        self.unload()
        config = check_shardable(model_path, self.world_size)
        self.vocab_size = config.get("text_config", config)["vocab_size"]
        self.model = load_shard(model_path, self.group)
        self.cache = make_prompt_cache(self.model)
        self._steps = 0
        self._fail_at = self._fault_step()
        return Loaded(parameter_count(self.model), time.perf_counter() - start)

    @property
    def offset(self) -> int:
        return self.cache[0].offset if self.cache else 0

    def forward(self, tokens: list[int], offset: int) -> mx.array | None:
        """Append ``tokens`` to the sequence; rank 0 gets the next-token logits, workers ``None``.

        The prompt's last token goes through alone, so that only rank 0, and
        only for one position, computes the projection to the vocabulary.
        """
        if self.model is None or self.cache is None:
            raise RankError(f"rank {self.rank}: no model loaded; send load_shard first")
        if not tokens:
            raise RankError(f"rank {self.rank}: a step needs at least one token")
        if not all(0 <= t < self.vocab_size for t in tokens):
            raise RankError(f"rank {self.rank}: token ids must lie in [0, {self.vocab_size})")
        # A rank whose cache disagrees with the leader still runs the step, so
        # that its peers are not left waiting in a collective, then says so.
        desync = offset != self.offset
        cached = self.offset
        trunk = backbone(self.model)
        for start in range(0, len(tokens) - 1, PREFILL_CHUNK):
            chunk = mx.array(tokens[start : min(start + PREFILL_CHUNK, len(tokens) - 1)])[None]
            mx.eval(trunk(chunk, cache=self.cache), [c.state for c in self.cache])
        last = mx.array(tokens[-1:])[None]
        out = None
        if self.rank == 0:
            out = self.model(last, cache=self.cache)[0, -1, :]
            mx.eval(out)
        else:
            mx.eval(trunk(last, cache=self.cache))
        self._steps += 1
        if desync:
            raise RankError(
                f"rank {self.rank}: step at offset {offset} but the KV cache held {cached} tokens; "
                "clear_kv_cache to resynchronize"
            )
        if self._steps == self._fail_at:
            raise InjectedFault(f"rank {self.rank}: injected failure after step {self._steps} ({FAULT_ENV})")
        return out

    def clear_kv_cache(self) -> None:
        if self.model is not None:
            self.cache = make_prompt_cache(self.model)

    def unload(self) -> None:
        self.model = None
        self.cache = None
        mx.clear_cache()
