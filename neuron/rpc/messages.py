"""The messages leader and workers exchange, one JSON object per line.

Every request carries an ``id`` that its reply echoes. The leader checks the id,
not only the reply's type, so a reply left over from an earlier call can never
be mistaken for the answer to this one.

Tensors never appear here: activations meet in ``mx.distributed`` collectives,
and rank 0 samples, so a worker's reply to a step is a few bytes whatever the
model's size. This module imports no MLX on purpose: the protocol must be
testable, and readable, without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

PROTOCOL_VERSION = 3

# A generous cap: the largest honest line is a step carrying a whole prompt
# (a 32k-token prompt is about 250 KB). Anything longer is a bug or an attack,
# and reading it whole would let one line exhaust a worker's memory.
MAX_LINE_BYTES = 4 * 1024 * 1024


class ErrorKind(StrEnum):
    """What went wrong, named so that the leader (and an operator) can act on it."""

    INVALID_JSON = "invalid_json"
    LINE_TOO_LONG = "line_too_long"
    UNKNOWN_OP = "unknown_op"
    INVALID_FIELD = "invalid_field"
    BAD_STATE = "bad_state"  # refused before any collective, or failed after all of them: the group is in step
    INIT_FAILED = "init_failed"
    LOAD_FAILED = "load_failed"
    GROUP_FAILED = "group_failed"  # the forward or a collective itself failed: the group is suspect
    INTERNAL = "internal"


# Requests, leader -> worker.


@dataclass(frozen=True, slots=True)
class Ping:
    op: ClassVar[str] = "ping"
    id: int


@dataclass(frozen=True, slots=True)
class Init:
    """Join the ``mx.distributed`` group.

    ``env`` holds the variables MLX reads for this rank and backend (for the
    ring: ``MLX_RANK`` and ``MLX_HOSTFILE``). The leader computes them, so a
    worker needs no knowledge of any backend's configuration.
    """

    op: ClassVar[str] = "init"
    id: int
    backend: str
    env: dict[str, str]


@dataclass(frozen=True, slots=True)
class LoadShard:
    op: ClassVar[str] = "load_shard"
    id: int
    model_path: str


@dataclass(frozen=True, slots=True)
class Prefill:
    """A chunk of one sequence's prompt, fed at ``position`` (0 starts the sequence).

    ``last`` marks the chunk that ends the prompt: rank 0 gets that sequence's
    next-token logits, and the sequence joins the batch in a later step's decode.
    """

    seq: int
    position: int
    tokens: list[int]
    last: bool


@dataclass(frozen=True, slots=True)
class Decode:
    """One row of the batched decode: ``token`` (sampled in the previous step) is fed to ``seq``."""

    seq: int
    token: int


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Everything one batched step changes, the same for every rank.

    In this order: the sequences in ``leave`` are dropped; sequences listed in
    ``decode`` whose prompt ended in an earlier step join the batch, after those
    already in it; each ``prefill`` chunk is fed; then the batch decodes one
    token per sequence, in ``decode`` order. The plan alone fixes every tensor
    shape, so every rank issues the same collectives even when its own state
    disagrees.
    """

    leave: list[int] = field(default_factory=list)
    prefill: list[Prefill] = field(default_factory=list)
    decode: list[Decode] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(len(chunk.tokens) for chunk in self.prefill)


@dataclass(frozen=True, slots=True)
class GenerateStep:
    op: ClassVar[str] = "generate_step"
    id: int
    plan: StepPlan


@dataclass(frozen=True, slots=True)
class ClearKvCache:
    op: ClassVar[str] = "clear_kv_cache"
    id: int


@dataclass(frozen=True, slots=True)
class Unload:
    op: ClassVar[str] = "unload"
    id: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    op: ClassVar[str] = "shutdown"
    id: int


# Replies, worker -> leader.


@dataclass(frozen=True, slots=True)
class Pong:
    op: ClassVar[str] = "pong"
    id: int
    rank: int
    world_size: int
    protocol: int
    pid: int


@dataclass(frozen=True, slots=True)
class InitOk:
    """``all_sum`` is the sanity all-reduce of 1.0 from every rank: it must equal the world size."""

    op: ClassVar[str] = "init_ok"
    id: int
    all_sum: float


@dataclass(frozen=True, slots=True)
class LoadShardOk:
    op: ClassVar[str] = "load_shard_ok"
    id: int
    parameters: int
    seconds: float


@dataclass(frozen=True, slots=True)
class GenerateStepOk:
    """``fingerprint`` digests the worker's batch state after the step; the leader compares it with rank 0's."""

    op: ClassVar[str] = "generate_step_ok"
    id: int
    fingerprint: str


@dataclass(frozen=True, slots=True)
class KvCacheCleared:
    op: ClassVar[str] = "kv_cache_cleared"
    id: int


@dataclass(frozen=True, slots=True)
class Unloaded:
    op: ClassVar[str] = "unloaded"
    id: int


@dataclass(frozen=True, slots=True)
class Bye:
    op: ClassVar[str] = "bye"
    id: int


@dataclass(frozen=True, slots=True)
class Error:
    """The one failure reply. ``id`` is null when the request was too broken to read one."""

    op: ClassVar[str] = "error"
    id: int | None
    kind: str
    message: str


Request = Ping | Init | LoadShard | GenerateStep | ClearKvCache | Unload | Shutdown
Reply = Pong | InitOk | LoadShardOk | GenerateStepOk | KvCacheCleared | Unloaded | Bye | Error

REQUESTS: tuple[type[Request], ...] = (Ping, Init, LoadShard, GenerateStep, ClearKvCache, Unload, Shutdown)
REPLIES: tuple[type[Reply], ...] = (Pong, InitOk, LoadShardOk, GenerateStepOk, KvCacheCleared, Unloaded, Bye, Error)

# The one success reply each request expects; anything else (bar Error) is a protocol violation.
EXPECTED_REPLY: dict[type[Request], type[Reply]] = {
    Ping: Pong,
    Init: InitOk,
    LoadShard: LoadShardOk,
    GenerateStep: GenerateStepOk,
    ClearKvCache: KvCacheCleared,
    Unload: Unloaded,
    Shutdown: Bye,
}

__all__ = [
    "ErrorKind",
    "Prefill",
    "Decode",
    "Ping",
    "Init",
    "LoadShard",
    "GenerateStep",
    "ClearKvCache",
    "Unload",
    "Shutdown",
    "Pong",
    "InitOk",
    "LoadShardOk",
    "GenerateStepOk",
    "KvCacheCleared",
    "Unloaded",
    "Bye",
    "Error",
    "PROTOCOL_VERSION",
    "MAX_LINE_BYTES",
    "Request",
    "Reply",
    "REQUESTS",
    "REPLIES",
    "EXPECTED_REPLY",
    "StepPlan",
]
