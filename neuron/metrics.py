"""Prometheus metrics for the leader, served at ``GET /metrics``. No MLX.

One registry per process, as Prometheus clients expect: the engine and the
pool update it, the HTTP server renders it. Workers keep none; the leader sees
every step's timing from its side of the pipes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()

# Seconds: a step on a tiny model takes milliseconds, a prefill of a long prompt seconds.
_FAST = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SLOW = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

REQUESTS = Counter(
    "neuron_requests",
    "Requests ended, by outcome: stop, length, cancelled (the client left), failed, rejected (refused at the door)",
    ["outcome"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter("neuron_prompt_tokens", "Prompt tokens of admitted requests", registry=REGISTRY)
# Usage by API key, named (--api-key, --api-keys-file): counted as each request ends, never for a server without keys.
KEY_REQUESTS = Counter(
    "neuron_key_requests",
    "Requests ended, by the name of the API key they came with and by outcome (as neuron_requests)",
    ["key", "outcome"],
    registry=REGISTRY,
)
KEY_PROMPT_TOKENS = Counter(
    "neuron_key_prompt_tokens", "Prompt tokens of the requests ended, by API key name", ["key"], registry=REGISTRY
)
KEY_COMPLETION_TOKENS = Counter(
    "neuron_key_completion_tokens",
    "Tokens generated for the requests ended, by API key name",
    ["key"],
    registry=REGISTRY,
)
PREFILL_TOKENS = Counter(
    "neuron_prefill_tokens", "Prompt tokens computed by the model (n > 1 computes a prompt once)", registry=REGISTRY
)
COMPLETION_TOKENS = Counter("neuron_completion_tokens", "Tokens generated", registry=REGISTRY)
TIME_TO_FIRST_TOKEN = Histogram(
    "neuron_time_to_first_token_seconds", "From admission to the first token", buckets=_SLOW, registry=REGISTRY
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "neuron_time_per_output_token_seconds",
    "Mean time between a request's tokens after the first",
    buckets=_FAST,
    registry=REGISTRY,
)
STEP_SECONDS = Histogram(
    "neuron_step_seconds",
    "Step latency by part: total; fanout (writing the plan to every worker); rank0 (rank 0's forward and "
    "sampling); drain (after rank 0's result, until the last worker replied)",
    ["part"],
    buckets=_FAST,
    registry=REGISTRY,
)
WAITING = Gauge("neuron_requests_waiting", "Requests queued for a place in the batch", registry=REGISTRY)
RUNNING = Gauge("neuron_requests_running", "Requests in the batch (prompt being fed, or decoding)", registry=REGISTRY)
READY = Gauge("neuron_ready", "1 when a probe step has passed on every rank since the last failure", registry=REGISTRY)
DESYNCS = Counter("neuron_desyncs", "Steps failed because a rank's state digest differed", registry=REGISTRY)
STEPS_AHEAD = Counter(
    "neuron_steps_run_ahead",
    "Decode steps queued on the device before the last one's tokens were read",
    registry=REGISTRY,
)
WORKER_RESTARTS = Counter(
    "neuron_worker_restarts", "Times the leader restarted with fresh workers after losing a rank", registry=REGISTRY
)
LEADER_RESTARTS = Counter(
    "neuron_leader_restarts",
    "Times the leader re-executed itself, the last resort after a lost group, by cause: unreachable (a host out of "
    "reach at start), unrecoverable (rank 0 could not leave the lost group), recovery_failed (not back within "
    "--resume-timeout), resume_off (--resume-timeout 0)",
    ["cause"],
    registry=REGISTRY,
)
RANK_MOVES = Counter(
    "neuron_rank_moves",
    "Times a rank moved to another host, by cause: unreachable (its host out of reach past --spare-timeout, the rank "
    "moved to a spare), drained (its host drained by the operator, neuron hosts drain)",
    ["cause"],
    registry=REGISTRY,
)
GROUP_SHRINKS = Counter(
    "neuron_group_shrinks",
    "Times the group went on without ranks whose hosts stayed out of reach past --spare-timeout with no spare left: "
    "the model split again over the ranks that remain",
    registry=REGISTRY,
)
RANK0_ABANDONED = Counter(
    "neuron_rank0_threads_abandoned",
    "Times rank 0's thread stayed inside a lost group's collective and a fresh one took its place",
    registry=REGISTRY,
)
RESUMED = Counter(
    "neuron_requests_resumed",
    "Requests that went on after a pause (a lost group, a preemption), fed their prompt and output so far again "
    "(once per pause)",
    registry=REGISTRY,
)
REPLAYED_TOKENS = Counter(
    "neuron_replayed_tokens",
    "Tokens fed again to resume paused requests (prompts and the output so far)",
    registry=REGISTRY,
)
RANKS = Gauge(
    "neuron_rank_info",
    "1 for each rank of the group, labelled by the host it runs on",
    ["rank", "host"],
    registry=REGISTRY,
)
STAGE_LAYERS = Gauge(
    "neuron_stage_layers",
    "Layers each rank holds as a pipeline stage (--pp), by rank and host",
    ["rank", "host"],
    registry=REGISTRY,
)
PREFIX_HITS = Counter(
    "neuron_prefix_cache_hits", "Prompts that began with a cached prefix (--prefix-cache-bytes)", registry=REGISTRY
)
PREFIX_MISSES = Counter("neuron_prefix_cache_misses", "Prompts with no cached prefix", registry=REGISTRY)
SPECULATIVE_PROPOSED = Counter(
    "neuron_speculative_proposed_tokens",
    "Draft tokens proposed (prompt lookup, prediction) and verified",
    registry=REGISTRY,
)
SPECULATIVE_ACCEPTED = Counter(
    "neuron_speculative_accepted_tokens", "Draft tokens verified and kept", registry=REGISTRY
)
PREFIX_CACHED_TOKENS = Counter(
    "neuron_prefix_cache_cached_tokens", "Prompt tokens restored from the prefix cache, not computed", registry=REGISTRY
)
PREFIX_EVICTIONS = Counter(
    "neuron_prefix_cache_evictions",
    "Prefix-cache entries dropped to stay within the budget, or covered by a longer one",
    registry=REGISTRY,
)
PREFIX_BYTES = Gauge(
    "neuron_prefix_cache_bytes",
    "Bytes of prefix-cache entries on the rank holding the largest share",
    registry=REGISTRY,
)
# The memory budget (neuron.engine.memory), each rank's as last read: what it may hold in all, what its process
# holds, what it could still take, what its caches hold, what is kept free for a step and as headroom, and what its
# caches may hold (its budget).
MEMORY_BYTES = Gauge(
    "neuron_memory_bytes",
    "Each rank's memory as last read, by part: total, used, free, caches, steps, headroom, budget",
    ["rank", "part"],
    registry=REGISTRY,
)
# vLLM's names: the share of the budget the caches hold, and the sequences preempted, here by why.
KV_CACHE_USAGE = Gauge(
    "neuron_kv_cache_usage_perc",
    "Share of the memory budget (the rank whose budget rules) the batch's caches and the prefix cache hold, 0 to 1",
    registry=REGISTRY,
)
PREEMPTIONS = Counter(
    "neuron_num_preemptions",
    "Sequences paused with their streams open and resumed later: memory (the batch outgrew the budget), "
    "allocation_failed (a rank failed to allocate anyway), priority (a request of higher priority took the place), "
    "fair_share (a request of an API key under its share of the batch took the place)",
    ["reason"],
    registry=REGISTRY,
)
PUSH_BYTES = Counter(
    "neuron_push_bytes",
    "Bytes of the model sent to a host that lacked its share (--push-model), by host",
    ["host"],
    registry=REGISTRY,
)
HUB_BYTES = Counter(
    "neuron_hub_bytes",
    "Bytes of model files fetched from the Hugging Face Hub (--model ORG/NAME) by this process",
    registry=REGISTRY,
)
