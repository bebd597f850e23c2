"""One request on its way through the engine, and the events it streams back.

No MLX here: the HTTP server reads these types without loading a model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from neuron.engine.drafts import Proposer
from neuron.sampling_params import SamplingParams
from neuron.tracing import RequestSpan

if TYPE_CHECKING:
    from neuron.engine.image_prompts import PromptImage, Rope


@dataclass(frozen=True, slots=True)
class Chunk:
    """One generated token, the text it released, and its logprobs (when asked for).

    ``text`` may be empty: mid-character, or held back while it might be the
    start of a stop string.
    """

    token: int
    text: str
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop" (end of sequence or a stop string), "length", or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    text: str  # the last text released (held back until the end)
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not computed
    cache_write_tokens: int = 0  # prompt tokens it wrote to the prefix cache: those saved past those restored
    # Speculation's draft tokens kept and rejected (OpenAI's accepted/rejected_prediction_tokens).
    accepted_tokens: int = 0
    rejected_tokens: int = 0
    embedding: bytes = b""  # an embedding input's vector (``Sampled.embedding``); nothing else is generated


@dataclass(frozen=True, slots=True)
class Failure:
    """The request could not be finished; ``message`` names the rank and the cause."""

    # "unavailable" (not ready, shutting down: retry elsewhere or later), "step_failed", or "constraint" (this
    # request's output constraint reached a dead end; the batch goes on)
    kind: str
    message: str
    prompt_tokens: int
    completion_tokens: int


Event = Chunk | Finish | Failure


class StopText:
    """Releases generated text, holding back any tail that could still become a stop string.

    A stop string split across tokens ("\\n\\nUs" then "er:") is caught because
    its beginning is never released until it can no longer be one.
    """

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include  # vLLM's include_stop_str_in_output: the stop string ends the text
        self._pending = ""

    def push(self, text: str, armed: bool = True) -> tuple[str, bool]:
        """Add text; return what may be released now and whether a stop string was reached. Until ``armed``
        (vLLM's ``min_tokens`` not yet reached) no stop string counts, and nothing is held back."""
        pending = self._pending + text
        if not armed:
            self._pending = ""
            return pending, False
        hits = [(i, i + len(stop) if self.include else i) for stop in self.stops if (i := pending.find(stop)) >= 0]
        if hits:
            self._pending = ""
            return pending[: min(hits)[1]], True
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(pending)), held, -1):
                if pending.endswith(stop[:k]):
                    held = k
                    break
        self._pending = pending[len(pending) - held :]
        return pending[: len(pending) - held], False

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return pending


class Status(enum.Enum):
    """Where a sequence stands in the scheduler (nano-vllm's and vLLM's sequence status); only the scheduler
    sets it."""

    WAITING = "waiting"  # queued (or paused after a lost group, to be fed again), not admitted
    FILLING = "filling"  # admitted: its prompt is being fed
    RUNNING = "running"  # decoding, a token (and a draft) each step
    FINISHED_STOPPED = "stop"  # an end-of-sequence or stop token, a stop string, or an embedding's vector
    FINISHED_LENGTH = "length"  # max_tokens reached
    FINISHED_ERROR = "error"  # its output constraint failed, or it was blamed for too many lost groups
    FINISHED_ABORTED = "aborted"  # cancelled by its caller, or failed with the batch

    @property
    def finished(self) -> bool:
        return self not in (Status.WAITING, Status.FILLING, Status.RUNNING)


@dataclass(frozen=True, slots=True)
class Pause:
    """Why a sequence is paused, its stream open, waiting to be fed its prompt and output again: the group was lost
    under it (``reason`` "lost": ``engine.resume``), or it was preempted ("memory": the batch's caches would pass
    the memory budget, ``engine.memory``; "priority": a waiting request of higher priority took its place; "fair_share":
    one of an API key holding less than its share of the batch did, ``engine.fairness``)."""

    reason: str
    rank: int  # the rank whose loss broke the group, or whose budget it would have passed
    host: str
    cause: str
    at: float  # perf_counter time it was paused


@dataclass(eq=False)
class Sequence:
    """A request's state in the engine. The engine writes its events; the caller reads them."""

    request_id: str  # the client's request id, shared by its n choices
    no: int  # the sequence's number in step plans
    prompt: list[int]
    max_tokens: int  # what the request asked for, capped by what the context leaves and --max-completion-tokens
    params: SamplingParams
    stop: StopText
    fed: int = 0  # prompt tokens fed so far, those restored from the prefix cache included
    cached: int = 0  # prompt tokens restored from the prefix cache
    priority: int = 0  # the request's: lower is sooner (``--scheduling-policy priority``)
    # The name of the API key it came with (``--api-key``, ``--api-keys-file``): its fair share (``engine.fairness``)
    # and usage; None where the server has no keys.
    key: str | None = None
    # Its request's OpenTelemetry span (``--otlp-traces-endpoint``), on the request's first sequence only; the
    # span's trace id on each of them, for their log entries.
    trace: RequestSpan | None = None
    trace_id: str | None = None
    cache_saved: int = 0  # prompt tokens the prefix-cache entry saved as its prompt ended holds (0: none saved)
    held: int = 0  # tokens every rank's cache holds for it that it keeps: its prompt, then the output fed
    next_token: int | None = None  # sampled, to be fed in the next step
    micro_batch: int = 0  # the micro-batch it decodes in, from the step its prompt ends
    completion_tokens: int = 0
    # Each prompt token's (logprob, top) but the first's, once the prompt is done, when prompt_logprobs asked.
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()
    detokenizer: Any = None  # mlx-lm's streaming detokenizer (engine.text)
    submitted: float = 0.0  # perf_counter times: queued, admitted to the batch, first token
    started: float = 0.0
    first_token_at: float = 0.0
    status: Status = Status.WAITING
    # The engine's step count when the caller stopped listening; None while it listens.
    cancelled_at: int | None = None
    finished: bool = False  # its reader has had its last event (a ``Finish`` or a ``Failure``)
    # n > 1: the sequences whose prompt is this one's, copied on every rank when it ends rather than computed
    # again; they wait in the batch, unfed, until then.
    copies: list[Sequence] = field(default_factory=list)
    copy_of: Sequence | None = None
    # An embedding input: how its final hidden states are pooled (``MEAN`` or ``LAST``); None for a generation.
    # ``group``: the other inputs of its request, queued with it as one request and admitted with it.
    pooling: str | None = None
    group: list[Sequence] = field(default_factory=list)
    # Speculation (engine.drafts): None when this sequence does not speculate. ``output`` is the completion
    # so far (the prompt lookup searches it); ``drop`` how many tokens the ranks drop from its cache next step.
    images: tuple[PromptImage, ...] = ()  # where image features replace the prompt's embeddings (engine.vision)
    rope: Rope | None = None  # its M-RoPE positions, where its images make them other than plain (engine.vision)
    proposer: Proposer | None = None
    output: list[int] = field(default_factory=list)
    drop: int = 0
    # Resuming after a pause (a lost group, a preemption): why it is paused (None while it runs), the tokens fed
    # again once it resumes (its prompt and its output so far; None: its prompt alone, as at first), and the losses
    # blamed on it.
    paused: Pause | None = None
    replay: list[int] | None = None
    losses: int = 0
    alone: bool = False  # fed on its own since a pause, even as one of n choices: its original's cache is gone
    # Admission: its order among admissions (the newest is preempted first), and the tokens its caches are reserved
    # (its tokens when admitted, and room for its output to grow: ``engine.memory``).
    admitted: int = 0
    reserved: int = 0
    adapter: int = 0  # the LoRA adapter it is generated with (the engine's number for it); 0: the base model
    _send: MemoryObjectSendStream[Event] = field(init=False, repr=False)
    events: MemoryObjectReceiveStream[Event] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Unbounded: the step loop must never wait on a slow reader. A request's
        # backlog is at most one small event per token it was allowed.
        self._send, self.events = anyio.create_memory_object_stream[Event](float("inf"))

    @property
    def n(self) -> int:
        """Places it takes in the batch: itself and its copies (each on its own since a loss)."""
        return 1 if self.alone else 1 + len(self.copies)

    @property
    def fed_with(self) -> list[Sequence]:
        """The copies that start from this sequence's cache once its prompt is fed."""
        return [] if self.alone else [c for c in self.copies if not c.alone]

    @property
    def tokens(self) -> list[int]:
        """What its cache must hold before it samples: its prompt, and since a loss its output so far too."""
        return self.prompt if self.replay is None else self.replay

    @property
    def ids(self) -> dict[str, str]:
        """What names it in a log entry: its request's id, its trace's where traces are on, its API key's name where
        it came with one."""
        ids = {"request_id": self.request_id}
        if self.trace_id:
            ids["trace_id"] = self.trace_id
        if self.key is not None:
            ids["key"] = self.key
        return ids

    def emit(self, event: Event) -> None:
        """Hand an event to the reader; a reader that has gone away counts as a cancellation."""
        if isinstance(event, Finish | Failure):
            self.finished = True
        try:
            self._send.send_nowait(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        if self.finished:
            self._send.close()
