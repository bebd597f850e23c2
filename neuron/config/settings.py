"""Every setting of ``neuron serve`` and ``neuron generate``, each declared once, as a field of the settings
object the subsystem that reads it receives.

A field's name is the setting's name: ``--max-batch``, ``NEURON_MAX_BATCH`` and
``max_batch`` in the TOML file are the field ``Scheduling.max_batch``. Its
annotation is the type, its value the default, and ``setting(...)`` (``neuron.config.setting``,
what a setting is) adds the help, the bounds and the commands that take it. The flags (config.py), the
reference table of the docs (neuron/cli/reference.py) and the defaults of
``Scheduling``, ``HttpLimits``, ``Serving`` and ``Deadlines.step`` all come from
here: a default written anywhere else is a bug (tests/unit/config/test_settings.py looks).

Plain data, no MLX, no engine: the engine imports ``Scheduling`` from here, not
the other way round.
"""

from __future__ import annotations

import os
import re
from dataclasses import MISSING, dataclass, fields
from typing import Any, get_type_hints

from neuron.config.setting import BOTH, GENERATE, Setting, setting
from neuron.models.folder import KV_GROUP_SIZE, POOLING_TYPES
from neuron.sampling_params import SamplingParams

LOG_LEVELS = ("trace", "debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console", "journal")


def _not_blank(v: str) -> str | None:
    return None if v.strip() else "is empty; give a value or leave it unset"


def _key_list(v: str) -> str | None:
    if not v.strip():
        return _not_blank(v)
    return None if all(key.strip() for key in v.split(",")) else "has an empty key; give each key, or leave it unset"


def _absolute_paths(v: str) -> str | None:
    relative = [p for p in v.split(":") if not os.path.isabs(p)]
    return (
        f"must list absolute directories separated by ':', got {', '.join(map(repr, relative))}" if relative else None
    )


def _adapter_list(v: str) -> str | None:
    from neuron.models.adapters import AdapterError, parse_list

    try:
        parse_list(v)
    except AdapterError as e:
        return f"is not a list of NAME=PATH: {e}"
    return None


KV_BITS = (8, 4)
# The fewest prompt tokens a step feeds beside decoding streams, so that a prompt still moves where a decode step
# alone takes --itl-target-ms or longer.
MIN_PREFILL_CHUNK = 16


def _kv_bits(v: int) -> str | None:
    return (
        None
        if v in KV_BITS
        else f"must be 8 or 4 (bits per cached key and value), got {v}; leave it unset to keep it unquantized"
    )


@dataclass(frozen=True, slots=True)
class Launch:
    """Where the model comes from and how its ranks start (neuron.launch, neuron.pool)."""

    model: str | None = setting(
        None,
        "model folder, .gguf file or Hub name; serve takes it more than once (or a settings file's [[models]] "
        "tables) for several models, each in a server of its own behind this one",
        commands=BOTH,
        unset="the embedded SmolLM2-135M-Instruct",
        repeatable=True,
    )
    tp: int | None = setting(
        None, "tensor-parallel ranks", commands=BOTH, at_least=1, unset="one per --hosts entry, else 1"
    )
    pp: int = setting(
        1,
        "pipeline stages: the model's layers split into this many runs of whole layers, one per rank",
        commands=BOTH,
        at_least=1,
    )
    pp_layers: str | None = setting(
        None,
        "layers per pipeline stage, e.g. 10,20",
        commands=BOTH,
        check=_not_blank,
        unset="in proportion to each host's free memory",
    )
    hosts: str | None = setting(
        None,
        "hostfile (mlx.launch's JSON: one entry per rank, entry 0 this host) to split the model over other hosts, "
        "started over SSH",
        commands=BOTH,
        unset="every rank on this host",
    )
    ssh_command: str = setting(
        "ssh",
        "the ssh command for --hosts, with its options, e.g. 'ssh -F /etc/neuron/ssh_config'",
        commands=BOTH,
        check=_not_blank,
    )
    push_model: bool = setting(
        False,
        "with --hosts, send a host that lacks the model (or holds another) the share its ranks load, over SSH, "
        "into its neuron cache",
        commands=BOTH,
        why="such a host is refused",
    )
    backend: str = setting(
        "ring",
        "mx.distributed backend for --tp > 1",
        commands=BOTH,
        choices=("ring", "jaccl", "nccl"),
        why="jaccl and nccl untested here",
    )
    data_plane: str = setting(
        "direct",
        "how the ring's links between hosts travel: direct (plain TCP between the hostfile's ips; keep it on a "
        "private link) or ssh (each link tunnelled through the leader's SSH connections, encrypted)",
        commands=BOTH,
        choices=("direct", "ssh"),
    )
    step_timeout: float = setting(
        120.0, "seconds a step may take on any rank before it is declared lost", commands=BOTH, positive=True
    )
    spare_timeout: float = setting(
        20.0,
        "seconds a rank's host may stay out of reach, once its rank is lost, before the rank moves to one of the "
        "hostfile's spares (a host back sooner keeps its rank); shorter than --resume-timeout",
        positive=True,
    )


@dataclass(frozen=True, slots=True)
class Logging:
    """What the leader logs, and how; its workers log the same way."""

    log_level: str = setting(
        "info",
        "trace is one event per step",
        commands=BOTH,
        choices=LOG_LEVELS,
        per_command={"generate": "warning"},  # generate's output is its answer; log lines would interleave
    )
    log_format: str = setting(
        "auto",
        "auto: the journal under systemd, readable on a terminal, JSON lines otherwise",
        commands=BOTH,
        choices=LOG_FORMATS,
    )


@dataclass(frozen=True, slots=True)
class Serving:
    """Where the server listens, who may load what, and how it stops (neuron.cli.serve)."""

    model_dirs: str | None = setting(
        None,
        "directories, ':'-separated, that --model must lie in once symlinks are followed",
        check=_absolute_paths,
        unset="anywhere",
    )
    served_model_name: str | None = setting(
        None,
        "the name clients send as `model` and replies carry (vLLM's flag); a router of several models gives each "
        "its [[models]] table's name",
        unset="the model folder's name, the .gguf file's stem, or the Hub name",
    )
    host: str = setting("127.0.0.1", "address to listen on", why="loopback only")
    port: int = setting(8000, "TCP port; 0 picks a free one", at_least=0, at_most=65535)
    api_key: str | None = setting(
        None,
        "require `Authorization: Bearer KEY` on /v1 and the page (a browser gives it as Basic's password); repeat "
        "the flag for several keys, named key-1, key-2, ... (each may call the admin routes), or separate them with "
        "commas",
        check=_key_list,
        unset="no key",
        repeatable=True,
    )
    api_keys_file: str | None = setting(
        None,
        'a JSON file of named API keys, {"keys": [{"name": N, "key": K, "admin": false, "best_priority": null}]}: '
        "each key's usage is counted under its name and no key holds more than its share of the batch and of the "
        "queue while others have requests in flight; beside --api-key's keys",
        unset="none",
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        "where each request's OpenTelemetry trace is sent, over OTLP/HTTP (a collector's /v1/traces URL; vLLM's "
        "flag); needs neuron[traces]",
        unset="no traces",
    )
    trace_step_ratio: float = setting(
        0.05,
        "the share of a traced request's steps whose time on each rank is a span of its own, so that a slow rank shows",
        at_least=0,
        at_most=1,
    )
    adapter: str | None = setting(
        None,
        "a LoRA adapter served as a model of its own, NAME=PATH (a folder in mlx-lm's or PEFT's format, or a Hub "
        "name); repeat the flag, or separate them with commas, for several",
        check=_adapter_list,
        unset="none",
        repeatable=True,
    )
    drain_timeout: float = setting(
        30.0, "seconds SIGTERM lets running requests finish before ending them with an error", at_least=0
    )


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Who may call, and what connections may hold (neuron.server.guard, neuron.server.connections)."""

    allowed_origins: str | None = setting(
        None,
        "web pages, comma-separated, that browsers may call the API from besides loopback ones, `*` matching "
        "anything, e.g. https://*.example.com; `*`: any",
        check=_not_blank,
        unset="loopback pages only",
    )
    allowed_hosts: str | None = setting(
        None,
        "names, comma-separated, the server answers to in the Host header besides IP addresses, localhost and "
        "this machine's name, `*` matching anything; `*`: any",
        check=_not_blank,
        unset="those only",
    )
    max_connections: int = setting(
        1024,
        "open HTTP connections; past it a new one closes the oldest idle one, or gets 503 when none is idle",
        at_least=1,
        why="and at most the descriptor limit less 128",
    )
    header_timeout: float = setting(
        10.0,
        "seconds a connection has to send a request's head, from connecting or from its first byte",
        positive=True,
    )
    keep_alive_timeout: float = setting(5.0, "seconds an idle connection stays open between requests", positive=True)
    no_page: bool = setting(False, "serve no page at / (a chat and the cluster's status, for browsers)")


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What a request's images may be, checked as the server reads the request, before anything queues
    (neuron.images)."""

    max_images: int = setting(16, "images per request, across its messages; more get 400", at_least=0)
    max_image_pixels: int = setting(
        4096 * 4096,
        "pixels per image (width x height), read from its header before it is decoded; larger get 400",
        at_least=1,
        why="4096 x 4096, generous for documents and screenshots; one such RGB picture is 50 MB decoded",
    )
    max_image_bytes: int = setting(
        20 * 1024 * 1024,
        "bytes per image as sent (before base64) or fetched; larger get 400",
        at_least=1,
        why="20 MiB, as OpenAI takes; a phone's photo is a few MiB as JPEG",
    )
    image_urls: bool = setting(
        False,
        "fetch the http(s) image URLs a request names (else only inline data: URLs are read)",
        why="fetching a URL a client names is a server-side request forgery risk: the server reaches what the "
        "client may not",
    )
    image_urls_private: bool = setting(
        False,
        "with --image-urls, fetch from private, loopback and link-local addresses too",
        why="a URL naming the server's own network (127.0.0.1, 10.0.0.0/8, 169.254.169.254) is refused",
    )
    image_fetch_timeout: float = setting(
        10.0, "seconds to fetch one image URL, its redirects included; slower get 400", positive=True
    )
    max_image_body_bytes: int = setting(
        64 * 1024 * 1024,
        "bytes of a request body to a route that takes images, where the model takes them; larger get 413",
        at_least=1,
        why="64 MiB: a few photos in base64; every other body stays at most 4 MiB",
    )


@dataclass(frozen=True, slots=True)
class Scheduling:
    """How the engine's scheduler runs the batch: its limits, speculation and running ahead (neuron.engine)."""

    max_batch: int = setting(8, "sequences decoding together; more wait in the queue", at_least=1)
    max_n: int = setting(8, "choices per request (n), at most --max-batch; more get 400", at_least=1)
    max_waiting: int = setting(64, "requests queued beyond the batch; more get 429", at_least=0)
    scheduling_policy: str = setting(
        "fcfs",
        "fcfs: requests join the batch in arrival order; priority: by each request's `priority` (lower is sooner, "
        "then arrival), and a waiting request preempts the batch's lowest-priority one when the batch or the memory "
        "is full (vLLM's flag and meanings)",
        choices=("fcfs", "priority"),
    )
    prefill_chunk: int = setting(
        512,
        "prompt tokens fed per step at most, across all prompts being fed, so long prompts do not stall running "
        "streams; while streams decode, --itl-target-ms sizes the chunk under it",
        at_least=1,
    )
    itl_target_ms: float = setting(
        200.0,
        "inter-token latency the running streams are kept at while prompts are fed beside them: each step feeds "
        f"as many prompt tokens (up to --prefill-chunk, at least {MIN_PREFILL_CHUNK}) as fit in this time after the "
        "decode rows, priced from the steps timed; 0 always feeds --prefill-chunk",
        at_least=0,
        why="5 tokens a second keeps a stream ahead of its reader",
    )
    max_context: int | None = setting(
        None, "tokens per request, prompt and completion", at_least=1, unset="the model's context"
    )
    max_completion_tokens: int | None = setting(
        None,
        "tokens one reply may generate at most, whatever its request asks (more is cut to fit, as past the "
        "context), so that no request holds a place in the batch for the whole context",
        at_least=1,
        unset="what the context leaves after the prompt",
    )
    micro_batches: int = setting(
        1,
        "decode passes per step, so that pipeline stages work at the same time",
        at_least=1,
        why="decode reads every weight once per pass, and on memory-bound hosts a second pass costs more than the "
        "overlap buys",
    )
    memory_share: float = setting(
        1.0,
        "the share of each rank's memory (what is free of it and what its caches hold) this server's caches may "
        "budget; a router of several models gives each of the models it may hold at once its part of it",
        at_least=0.01,
        at_most=1,
    )
    prefix_cache_bytes: int | None = setting(
        None,
        "bytes of KV cache at most, on the rank holding the largest share, kept for prompts' shared beginnings, "
        "reused by later prompts that start the same way; it holds what the running sequences leave of the memory "
        "budget, never more, and gives way to them first; 0 turns the prefix cache off",
        at_least=0,
        unset="what the running sequences leave of the memory budget",
    )
    prefix_cache_dir: str | None = setting(
        None,
        "a folder where each rank writes the prefix-cache entries evicted from memory, and all of them at "
        "shutdown; a restarted server with the same model and layout restores them instead of computing them",
        unset="memory only",
    )
    prefix_cache_dir_bytes: int = setting(
        16 << 30, "bytes of prefix-cache files each rank keeps in --prefix-cache-dir; the oldest go first", at_least=1
    )
    kv_bits: int | None = setting(
        None,
        "store the KV cache quantized to this many bits (8 or 4; mlx-lm's quantized cache, groups of "
        f"{KV_GROUP_SIZE} values), from a prompt's first token on; the prefix cache and --prefix-cache-dir hold it "
        "so too. Models whose caches are not all plain key/value ones are refused",
        commands=BOTH,
        check=_kv_bits,
        unset="unquantized, in the activations' dtype",
    )
    speculate: str = setting(
        "ngram",
        "where speculative decoding's draft tokens come from, verified in the batched step: ngram, prompt lookup and "
        "requests' `prediction` (or --draft-model's); mtp, the model's own multi-token-prediction layers (vLLM's "
        "method name; DeepSeek V3 and GLM-4.5, refused with the reason elsewhere); off: none",
        choices=("ngram", "mtp", "off"),
    )
    draft_model: str | None = setting(
        None,
        "draft model folder or Hub name (its tokenizer must be the model's): it runs whole on rank 0 and proposes "
        "each decoding row's draft tokens in place of prompt lookup; --speculate off turns it off",
        check=_not_blank,
        unset="none: drafts from prompt lookup only",
    )
    # Where MLX evaluates asynchronously (GPUs) running ahead hides the host's part of a step; its CPU backend
    # evaluates in the caller, so there it pays only where a step is mostly host time (``scheduler.runs_ahead``).
    run_ahead: str = setting(
        "auto",
        "in steady decode, queue each step on the device before reading the last one's tokens, so that the "
        "device never waits for the host",
        choices=("auto", "on", "off"),
        why="on on a GPU; on a CPU, only for one rank and where its measured step is short",
    )
    resume_timeout: float = setting(
        60.0,
        "seconds the requests in flight when a rank is lost wait for fresh workers, then go on where they "
        "stopped; 0: they fail at once and the leader restarts",
        at_least=0,
    )
    resume_tries: int = setting(
        2,
        "losses of a rank a request may be blamed for (fed when it happened) and still go on; the next ends it "
        "with an error, as it may be what kills the rank",
        at_least=0,
    )
    # Not the scheduler's to read: it plans what each embedding input's sequence says.
    pooling_type: str | None = setting(
        None,
        "how /v1/embeddings pools the final hidden states, vLLM's pooling types: MEAN over every position, or the "
        "LAST position's",
        choices=POOLING_TYPES,
        unset="what the model's sentence-transformers card says, else MEAN",
    )
    constrained_reasoning_tokens: int = setting(
        1024,
        "tokens of analysis a gpt-oss reply may write before the message that response_format or a forced tool "
        "call constrains",
        at_least=1,
    )


def _api_default(name: str) -> Any:
    """The API's own default for a sampling field: ``generate`` samples as a request that leaves it out."""
    return next(f.default for f in fields(SamplingParams) if f.name == name)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How ``generate`` samples its one prompt (neuron.sampling_params checks the values)."""

    max_tokens: int = setting(128, "tokens to generate at most", commands=GENERATE, at_least=1)
    chat: bool = setting(False, "wrap the prompt in the model's chat template", commands=GENERATE)
    temperature: float = setting(_api_default("temperature"), "0 is greedy", commands=GENERATE)
    top_p: float = setting(_api_default("top_p"), "nucleus sampling's mass", commands=GENERATE)
    top_k: int = setting(_api_default("top_k"), "sample among the k likeliest; 0: no limit", commands=GENERATE)
    min_p: float = setting(_api_default("min_p"), "drop tokens below this share of the likeliest", commands=GENERATE)
    seed: int | None = setting(
        _api_default("seed"), "make sampling reproducible", commands=GENERATE, unset="a fresh one"
    )


@dataclass(frozen=True, slots=True)
class Residency:
    """Which of several models stay loaded (neuron.router); one model is always loaded."""

    models_max: int | None = setting(
        None,
        "how many of the models may be loaded at once; asked for one more, the least recently used idle one unloads",
        at_least=1,
        unset="no cap",
    )
    keep_alive: float | None = setting(
        None,
        "seconds a model stays loaded with no request before it unloads (a [[models]] table's keep_alive, or a "
        "request's, Ollama's field, overrides it); negative: never",
        unset="never",
    )
    preload: bool = setting(False, "load every model at start, not on its first request")


GROUPS: tuple[type, ...] = (Launch, Logging, Serving, HttpLimits, ImageLimits, Scheduling, Residency, Sampling)


def _collect() -> dict[str, Setting]:
    out: dict[str, Setting] = {}
    for group in GROUPS:
        hints = get_type_hints(group)
        for f in fields(group):
            kind = next(t for t in getattr(hints[f.name], "__args__", (hints[f.name],)) if t is not type(None))
            assert f.default is not MISSING and f.name not in out, f"{group.__name__}.{f.name}"
            out[f.name] = Setting(f.name, kind, f.default, group.__name__, f.metadata["setting"])
    return out


SETTINGS = _collect()


def title(group: type) -> str:
    """A settings object's name as words: ``HttpLimits``, "http limits"."""
    return re.sub(r"(?<!^)(?=[A-Z][a-z])", " ", group.__name__).lower()


def default(name: str) -> Any:
    """A setting's default, for a class that holds the setting under a name of its own (``Deadlines.step``)."""
    return SETTINGS[name].default


def names(command: str) -> tuple[str, ...]:
    """The settings ``command`` takes, in the order of their declarations."""
    return tuple(name for name, s in SETTINGS.items() if command in s.commands)
