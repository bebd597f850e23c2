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

from neuron.rpc.plan import Decode, Evict, ImageRun, Prefill, Restore, Save, StepPlan

PROTOCOL_VERSION = 17
FLUSH_S = 20.0  # seconds a rank waits for its spilled prefix-cache entries to be written (``FlushPrefixDisk``)

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
    # An allocation failed on this rank's device (MLX out of memory) inside a step: the group is suspect as after
    # any failed forward, and the leader sizes the batch down when it resumes.
    OUT_OF_MEMORY = "out_of_memory"
    INTERNAL = "internal"


# Requests, leader -> worker.


@dataclass(frozen=True, slots=True)
class HostInfo:
    """What a rank says about its host in its handshake; the leader refuses hosts that would disagree."""

    hostname: str
    neuron: str
    mlx: str
    mlx_lm: str
    python: str
    platform: str
    free_memory: int  # bytes this rank could give a model now: its GPU's on a GPU backend, else the host's (or
    # less: the room left under its memory cgroup's limit)
    memory_limit: int  # that cgroup limit where one binds, in bytes; 0 where none does
    oom_counter: str  # the file on its host whose ``oom_kill`` line counts its cgroup's OOM kills; "" where none
    oom_kills: int  # that count when it answered; -1 where unknown
    cpus: list[int]  # the cores this process may run on
    gpus: int  # the NVIDIA GPUs the host's driver lists (nccl places one rank on each)


@dataclass(frozen=True, slots=True)
class Memory:
    """A rank's memory as it read it, live where ``HostInfo`` says what it was at the handshake: what the leader's
    memory budget for the rank is made of (``engine.memory``)."""

    used: int  # bytes this process holds: MLX's active memory on a GPU, else the process's resident set
    free: int  # bytes it could still take: as ``HostInfo.free_memory`` reads them
    at: float  # when it read them, in unix seconds
    total: int = 0  # the most it may hold in all: its cgroup's limit, its GPU's memory, else its host's; 0: unknown
    caches: int = 0  # bytes its KV caches and prefix-cache entries hold (counted in ``used``)
    peak: int = 0  # the most one step has taken beyond what it held before and after it, since the model loaded


@dataclass(frozen=True, slots=True)
class Ping:
    op: ClassVar[str] = "ping"
    id: int


@dataclass(frozen=True, slots=True)
class Listen:
    """Open a listener on each of this host's data-plane addresses, on a port free there.

    They stay open, so that the neighbouring rank can ``Probe`` them, until a
    ``Listen`` with no addresses closes them, before ``Init``, and MLX binds the
    same ports. Why: the ring's accept has no timeout, and its connect retries
    for about 30 s, so an address the neighbour cannot reach must be found
    before any rank joins the group.
    """

    op: ClassVar[str] = "listen"
    id: int
    ips: list[str]


@dataclass(frozen=True, slots=True)
class Probe:
    """Connect to each of the next rank's listeners, as the ring will; report those that cannot be reached."""

    op: ClassVar[str] = "probe"
    id: int
    addresses: list[str]


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What a worker needs to know before it loads MLX; it travels here because sshd drops environment variables.

    ``host`` is how the operator named the host (its hostfile's ``ssh``): logs
    carry it. ``cpus`` are the cores to pin to (empty: no pinning), with as
    many BLAS threads.
    """

    host: str
    log_level: str
    log_format: str
    cpus: list[int]


@dataclass(frozen=True, slots=True)
class Init:
    """Pin to the planned cores, then join the ``mx.distributed`` group.

    ``env`` holds the variables MLX reads for this rank and backend (for the
    ring: ``MLX_RANK``); ``files`` maps a variable to the content of a file the
    worker writes on its own host and names in that variable (the ring's
    ``MLX_HOSTFILE``). The leader computes both, so a worker needs no
    knowledge of any backend's configuration.
    """

    op: ClassVar[str] = "init"
    id: int
    backend: str
    env: dict[str, str]
    files: dict[str, str]
    settings: WorkerSettings


@dataclass(frozen=True, slots=True)
class CheckModel:
    """Find the model on this host (``model``: a folder or a .gguf file, null for the embedded default) and
    digest what decides what it computes, so the leader can check every host holds the same model.

    ``share`` (with ``--push-model``; empty otherwise) names the share of the leader's model this rank would load
    (``neuron.models.shares``): the reply says whether this host holds it whole, and a model missing here is no error.

    ``weights``: the safetensors files this rank loads from (a pipeline stage's, ``shares.files_read``), the
    only ones fetched of a model named on the Hub; empty: every one. ``token``: the leader's Hugging Face token
    for a host that fetches from the Hub itself (a gated repository), empty otherwise; it travels here, not on
    the ssh command line or in a process's arguments, and no log or ``repr`` shows it.
    """

    op: ClassVar[str] = "check_model"
    id: int
    model: str | None
    share: str = ""
    weights: list[str] = field(default_factory=list)
    token: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True)
class LoadShare:
    """Load this rank's share: a slice of every layer (``layers`` empty), or layers ``[first, end)`` whole, a
    pipeline stage. ``kv_bits``: its KV caches quantized to these bits (``--kv-bits``); None: not."""

    op: ClassVar[str] = "load_share"
    id: int
    model_path: str
    layers: list[int]
    kv_bits: int | None = None


@dataclass(frozen=True, slots=True)
class GenerateStep:
    op: ClassVar[str] = "generate_step"
    id: int
    plan: StepPlan
    # Every rank reads its memory once the step has run, and the reply carries the reading: the leader asks every
    # few seconds, on the same step for every rank.
    read_memory: bool = False


@dataclass(frozen=True, slots=True)
class LoadAdapter:
    """Load the LoRA adapter in the folder ``path`` as number ``adapter`` (the leader numbers them, never reusing
    one): this rank's slice of its matrices (``rank.model.lora``). Plans then name it on the rows it applies to."""

    op: ClassVar[str] = "load_adapter"
    id: int
    adapter: int
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class UnloadAdapter:
    """Drop LoRA adapter ``adapter``; no plan names it any more."""

    op: ClassVar[str] = "unload_adapter"
    id: int
    adapter: int


@dataclass(frozen=True, slots=True)
class ClearKvCache:
    """Drop every sequence's KV cache; with ``prefixes``, the prefix-cache entries too (after a failure)."""

    op: ClassVar[str] = "clear_kv_cache"
    id: int
    prefixes: bool


@dataclass(frozen=True, slots=True)
class OpenPrefixDisk:
    """Keep the prefix-cache entries the plans spill (``Evict.key``) as files in ``folder``, at most ``budget``
    bytes of this rank's; ``stamp`` names the model and the layout, and only files of the same stamp are loaded.
    The reply lists the files this rank could load: each key and its length."""

    op: ClassVar[str] = "open_prefix_disk"
    id: int
    folder: str
    budget: int
    stamp: str


@dataclass(frozen=True, slots=True)
class LoadPrefixes:
    """Drop the entries ``drop`` names where held (those another rank failed to load), then load the files
    ``entries`` names (key -> the entry id each becomes); the reply names those that failed."""

    op: ClassVar[str] = "load_prefixes"
    id: int
    entries: dict[str, int]
    drop: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FlushPrefixDisk:
    """Wait for this rank's spilled entries to be written (before a shutdown)."""

    op: ClassVar[str] = "flush_prefix_disk"
    id: int


@dataclass(frozen=True, slots=True)
class ReadMemory:
    """Read this rank's memory now (``MemoryRead``): the leader's budget needs every rank's reading once the model
    and its caches' first step are in place, and again after anything else loads. With limits, first keep MLX within
    them where it enforces them (Metal, CUDA): ``memory_limit`` bytes in all, ``cache_limit`` of freed buffers kept
    for reuse (0: as they are)."""

    op: ClassVar[str] = "read_memory"
    id: int
    memory_limit: int = 0
    cache_limit: int = 0


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
    host: HostInfo


@dataclass(frozen=True, slots=True)
class Listening:
    op: ClassVar[str] = "listening"
    id: int
    addresses: list[str]  # "ip:port", one per address asked for


@dataclass(frozen=True, slots=True)
class Probed:
    op: ClassVar[str] = "probed"
    id: int
    unreachable: dict[str, str]  # address -> why it could not be reached


@dataclass(frozen=True, slots=True)
class ModelChecked:
    """``path``: the model folder on this host; ``files``: each file that decides the model's output -> a digest
    (empty when the host has no model there); ``share``: the folder of the share asked for when this host holds
    it whole, every tensor matching its digest (empty otherwise)."""

    op: ClassVar[str] = "model_checked"
    id: int
    path: str
    files: dict[str, str]
    share: str = ""


@dataclass(frozen=True, slots=True)
class InitOk:
    """``all_sum`` is the sanity all-reduce of 1.0 from every rank: it must equal the world size."""

    op: ClassVar[str] = "init_ok"
    id: int
    all_sum: float


@dataclass(frozen=True, slots=True)
class LoadShareOk:
    op: ClassVar[str] = "load_share_ok"
    id: int
    parameters: int
    seconds: float


@dataclass(frozen=True, slots=True)
class MemoryRead:
    """A rank's memory, read when asked (``ReadMemory``) rather than every few seconds as a step's reply does."""

    op: ClassVar[str] = "memory_read"
    id: int
    memory: Memory


@dataclass(frozen=True, slots=True)
class GenerateStepOk:
    """``fingerprint`` digests the worker's batch state after the step; the leader compares it with rank 0's."""

    op: ClassVar[str] = "generate_step_ok"
    id: int
    fingerprint: str
    memory: Memory | None = None  # read after the step where it asked (``GenerateStep.read_memory``); else None


@dataclass(frozen=True, slots=True)
class AdapterLoaded:
    """``projections``: how many of this rank's projections the adapter adapts (none on a stage it skips)."""

    op: ClassVar[str] = "adapter_loaded"
    id: int
    projections: int


@dataclass(frozen=True, slots=True)
class AdapterUnloaded:
    op: ClassVar[str] = "adapter_unloaded"
    id: int


@dataclass(frozen=True, slots=True)
class KvCacheCleared:
    op: ClassVar[str] = "kv_cache_cleared"
    id: int


@dataclass(frozen=True, slots=True)
class PrefixDiskOpened:
    op: ClassVar[str] = "prefix_disk_opened"
    id: int
    saved: dict[str, int]  # key -> tokens, each file this rank may load


@dataclass(frozen=True, slots=True)
class PrefixesLoaded:
    op: ClassVar[str] = "prefixes_loaded"
    id: int
    failed: list[str]  # keys whose files were corrupted, truncated or missing here: not loaded


@dataclass(frozen=True, slots=True)
class PrefixDiskFlushed:
    op: ClassVar[str] = "prefix_disk_flushed"
    id: int
    written: bool  # False: the deadline passed first


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


Request = (
    Ping
    | Listen
    | Probe
    | Init
    | CheckModel
    | LoadShare
    | LoadAdapter
    | UnloadAdapter
    | GenerateStep
    | ClearKvCache
    | OpenPrefixDisk
    | LoadPrefixes
    | FlushPrefixDisk
    | ReadMemory
    | Shutdown
)
Reply = (
    Pong
    | Listening
    | Probed
    | InitOk
    | ModelChecked
    | LoadShareOk
    | AdapterLoaded
    | AdapterUnloaded
    | GenerateStepOk
    | KvCacheCleared
    | PrefixDiskOpened
    | PrefixesLoaded
    | PrefixDiskFlushed
    | MemoryRead
    | Bye
) | Error

REQUESTS: tuple[type[Request], ...] = (
    Ping,
    Listen,
    Probe,
    Init,
    CheckModel,
    LoadShare,
    LoadAdapter,
    UnloadAdapter,
    GenerateStep,
    ClearKvCache,
    OpenPrefixDisk,
    LoadPrefixes,
    FlushPrefixDisk,
    ReadMemory,
    Shutdown,
)
REPLIES: tuple[type[Reply], ...] = (
    Pong,
    Listening,
    Probed,
    InitOk,
    ModelChecked,
    LoadShareOk,
    AdapterLoaded,
    AdapterUnloaded,
    GenerateStepOk,
    KvCacheCleared,
    PrefixDiskOpened,
    PrefixesLoaded,
    PrefixDiskFlushed,
    MemoryRead,
    Bye,
    Error,
)

# The one success reply each request expects; anything else (bar Error) is a protocol violation.
EXPECTED_REPLY: dict[type[Request], type[Reply]] = {
    Ping: Pong,
    Listen: Listening,
    Probe: Probed,
    Init: InitOk,
    CheckModel: ModelChecked,
    LoadShare: LoadShareOk,
    LoadAdapter: AdapterLoaded,
    UnloadAdapter: AdapterUnloaded,
    GenerateStep: GenerateStepOk,
    ClearKvCache: KvCacheCleared,
    OpenPrefixDisk: PrefixDiskOpened,
    LoadPrefixes: PrefixesLoaded,
    FlushPrefixDisk: PrefixDiskFlushed,
    ReadMemory: MemoryRead,
    Shutdown: Bye,
}

__all__ = [
    "ErrorKind",
    "HostInfo",
    "Memory",
    "WorkerSettings",
    "Listen",
    "Listening",
    "Probe",
    "Probed",
    "CheckModel",
    "ModelChecked",
    "ImageRun",
    "Prefill",
    "Decode",
    "Restore",
    "Save",
    "Evict",
    "Ping",
    "Init",
    "LoadShare",
    "LoadAdapter",
    "UnloadAdapter",
    "GenerateStep",
    "ClearKvCache",
    "OpenPrefixDisk",
    "LoadPrefixes",
    "FlushPrefixDisk",
    "ReadMemory",
    "Shutdown",
    "Pong",
    "InitOk",
    "LoadShareOk",
    "AdapterLoaded",
    "AdapterUnloaded",
    "GenerateStepOk",
    "KvCacheCleared",
    "PrefixDiskOpened",
    "PrefixesLoaded",
    "PrefixDiskFlushed",
    "MemoryRead",
    "Bye",
    "Error",
    "PROTOCOL_VERSION",
    "FLUSH_S",
    "MAX_LINE_BYTES",
    "Request",
    "Reply",
    "REQUESTS",
    "REPLIES",
    "EXPECTED_REPLY",
    "StepPlan",
]
