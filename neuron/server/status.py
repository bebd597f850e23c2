"""``GET /v1/status``: the cluster at a glance, as the page (``page``) polls it: the model and its architecture,
each rank's host, device, memory (used and free, read live) and share of the model, the queue, the caches, the
counters the page turns into step time and tokens per second, and the latest losses and recoveries. No MLX.

Counters, not rates: the page keeps its own history between polls, so that the server keeps none per viewer.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from neuron import metrics
from neuron.models.folder import ModelError, read_config, text_config
from neuron.server.common.readiness import not_ready_because, rank_state
from neuron.server.common.schema import OpenApi, Schema, Spec, get, ref, replies
from neuron.server.http import Call, Endpoint, OrjsonResponse

if TYPE_CHECKING:
    from neuron.engine.engine import Engine
    from neuron.rpc import HostInfo


@functools.lru_cache(maxsize=4)
def _config(model_path: str) -> dict[str, Any]:
    try:
        return text_config(read_config(model_path))
    except (ModelError, OSError, ValueError):
        return {}


def architecture(model_path: str) -> dict[str, Any]:
    config = _config(model_path)
    return {
        "model_type": config.get("model_type"),
        "layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "attention_heads": config.get("num_attention_heads"),
        "kv_heads": config.get("num_key_value_heads", config.get("num_attention_heads")),
        "vocab_size": config.get("vocab_size"),
    }


def _sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


EVENTS_KEPT = 20  # the moves listed, as the recovery's events


def counters() -> dict[str, float]:
    return {
        "steps": _sample("neuron_step_seconds_count", part="total"),
        "step_seconds": _sample("neuron_step_seconds_sum", part="total"),
        "prompt_tokens": _sample("neuron_prompt_tokens_total"),
        "completion_tokens": _sample("neuron_completion_tokens_total"),
        "cancelled": _sample("neuron_requests_total", outcome="cancelled"),
        "prefix_cache_hits": _sample("neuron_prefix_cache_hits_total"),
        "prefix_cache_misses": _sample("neuron_prefix_cache_misses_total"),
        "preemptions": sum(
            _sample("neuron_num_preemptions_total", reason=reason) for reason in ("memory", "allocation_failed")
        ),
    }


def _device(info: HostInfo, backend: str) -> str:
    """What the rank computes on, and where: nccl places one rank on each GPU."""
    kind = "metal" if info.platform.startswith("darwin") else "cuda" if backend == "nccl" and info.gpus else "cpu"
    return f"{kind} ({info.platform})"


def ranks(engine: Engine) -> list[dict[str, Any]]:
    pool = engine.pool
    broken = pool.broken
    config = _config(pool.model_path)
    heads = config.get("num_attention_heads")
    layers = config.get("num_hidden_layers")
    said = pool.said
    budgets = {budget.rank: budget.describe() for budget in engine.budget.ranks}
    out = []
    for rank, host in enumerate(pool.hosts):
        info = said[rank] if rank < len(said) else None
        memory = pool.memory.get(rank)  # read live during the steps; before the first, what the handshake said
        state, reason = rank_state(rank, broken.failures if broken is not None else None, pool.loaded)
        staged = rank < len(pool.layers)
        out.append(
            {
                "rank": rank,
                "host": host,
                "hostname": info.hostname if info else None,
                "device": _device(info, pool.backend) if info else None,
                "state": state,
                "reason": reason,
                "weights_bytes": pool.weights[rank] if rank < len(pool.weights) else None,
                "used_bytes": memory.used if memory else None,
                "free_bytes": memory.free if memory else info.free_memory if info else None,
                "memory_read_at": memory.at if memory else None,
                "memory_limit_bytes": (info.memory_limit or None) if info else None,
                "layers": list(pool.layers[rank]) if staged else ([0, layers] if layers else None),
                "heads": None if staged or not heads else heads // pool.world_size,
                "memory": budgets.get(rank),
            }
        )
    return out


def caches(engine: Engine) -> dict[str, Any]:
    """The caches and the memory budget they share (``engine.memory``), in the bytes of the rank whose budget rules,
    on the scale of the one holding the largest share."""
    batch = engine.scheduler.batch
    tokens = sum(seq.fed + seq.completion_tokens for seq in batch)
    prefix = engine.prefix
    budget = engine.budget
    rank, host = budget.where()
    return {
        "kv_cache": {
            "sequences": len(batch),
            "max_sequences": engine.limits.max_batch,
            "tokens": tokens,
            "bytes": engine.scheduler.usage(),
        },
        "prefix_cache": {
            "enabled": prefix is not None,
            "entries": len(prefix.entries) if prefix else 0,
            "bytes": prefix.bytes if prefix else 0,
            "budget_bytes": prefix.budget if prefix else 0,
        },
        "memory": {
            "budget_bytes": budget.bytes,
            "rank": rank,
            "host": host,
            "usage": round(engine.pressure.usage(), 4),
            "longest_tokens": budget.longest(),
            "cap_bytes": budget.cap,
        },
    }


def status(call: Call) -> dict[str, Any]:
    state, engine = call.state, call.state.engine
    reason = not_ready_because(state)
    body: dict[str, Any] = {
        "object": "status",
        "model": {"id": state.model_id, "vision": False, "architecture": None, "context_length": None},
        "ready": reason is None,
        "reason": reason or "ready",
        "started": state.started,
        "counters": counters(),
        "ranks": [],
        "queue": {"waiting": 0, "running": 0},
        "events": [],
        "recoveries": 0,
        "recent": [],
        "now": time.time(),
    }
    if engine is None:
        return body
    pool = engine.pool
    body["model"] |= {
        "architecture": architecture(pool.model_path),
        "context_length": engine.context_length,
        # The page offers to attach an image only where the engine says its model takes images.
        "vision": engine.vision,
    }
    body |= {
        "world_size": pool.world_size,
        "pipeline_stages": len(pool.layers) or 1,
        "ranks": ranks(engine),
        "crowded": [machine.describe() for machine in pool.crowded],
        "queue": {"waiting": engine.waiting, "running": engine.running},
        "events": list(engine.recovery.events),
        "recoveries": engine.recovery.recoveries,
        "spares": pool.spares.describe(),
        "moves": [move.describe() for move in pool.spares.moves[-EVENTS_KEPT:]],
        "shrinks": [shrink.describe() for shrink in pool.roster.shrinks[-EVENTS_KEPT:]],
        "recent": engine.recent.seconds(),
        **caches(engine),
    }
    return body


async def serve(call: Call) -> Response:
    return OrjsonResponse(status(call))


ENDPOINTS = (Endpoint("/v1/status", serve, method="GET"),)


def openapi(spec: Spec) -> OpenApi:
    integer: Schema = {"type": "integer"}
    maybe_int: Schema = {"type": ["integer", "null"]}
    text: Schema = {"type": "string"}
    rank: Schema = {
        "type": "object",
        "required": [
            "rank",
            "host",
            "state",
            "weights_bytes",
            "used_bytes",
            "free_bytes",
            "memory_read_at",
            "layers",
            "heads",
        ],
        "properties": {
            "rank": integer,
            "host": text,
            "hostname": {"type": ["string", "null"]},
            "device": {"type": ["string", "null"]},
            "state": {"enum": ["ok", "starting", "lost"]},
            "reason": {"type": ["string", "null"]},
            "weights_bytes": maybe_int,
            "used_bytes": {
                "type": ["integer", "null"],
                "description": "what the rank's process holds: MLX's active memory on a GPU, else its resident set",
            },
            "free_bytes": {
                "type": ["integer", "null"],
                "description": "what the rank could still take: its GPU's free memory, else its host's (or its "
                "cgroup's room)",
            },
            "memory_read_at": {
                "type": ["number", "null"],
                "description": "when used_bytes and free_bytes were read, in unix seconds (every few seconds while "
                "steps run); null: free_bytes is from the rank's handshake",
            },
            "memory_limit_bytes": maybe_int,
            "layers": {"type": ["array", "null"], "items": integer},
            "heads": maybe_int,
            "memory": {
                "type": ["object", "null"],
                "description": "where the rank's memory goes, as last read (``engine.memory``): total (its cgroup's "
                "limit, its GPU's memory, else its host's), used, free, what its caches hold, what a step and the "
                "headroom keep free, and the budget its caches may hold (all bytes); the longest sequence that fits",
                "additionalProperties": {"type": ["integer", "string"]},
            },
        },
    }
    event: Schema = {
        "type": "object",
        "required": ["at", "event", "ranks", "reason"],
        "properties": {
            "at": {"type": "number"},
            "event": {"enum": ["lost", "recovered", "recovery failed", "moved", "drained", "shrunk", "not shrunk"]},
            "ranks": {"type": "array", "items": integer},
            "reason": text,
        },
    }
    number_map: Schema = {"type": "object", "additionalProperties": {"type": "number"}}
    body: Schema = {
        "type": "object",
        "required": [
            "object",
            "model",
            "ready",
            "reason",
            "counters",
            "ranks",
            "queue",
            "events",
            "recoveries",
            "recent",
        ],
        "properties": {
            "object": {"const": "status"},
            "model": {
                "type": "object",
                "required": ["id", "vision", "architecture", "context_length"],
                "properties": {
                    "id": {"const": spec.model_id},
                    "vision": {"type": "boolean"},
                    "architecture": {"type": ["object", "null"]},
                    "context_length": maybe_int,
                },
            },
            "ready": {"type": "boolean"},
            "reason": text,
            "started": integer,
            "world_size": integer,
            "pipeline_stages": integer,
            "counters": number_map,
            "ranks": {"type": "array", "items": rank},
            "queue": number_map,
            "kv_cache": number_map,
            "prefix_cache": {"type": "object"},
            "memory": {
                "type": "object",
                "description": "the caches' memory budget that rules (its rank and host), the share the batch and "
                "the prefix cache hold, the longest sequence it holds alone, and its cap after a failed allocation",
            },
            "events": {"type": "array", "items": event},
            "recoveries": integer,
            "spares": {
                "type": "array",
                "description": "the hostfile's spares, in the order they are taken: standing by, or returning (a host "
                "that lost its rank, a spare again, tried after the others)",
                "items": {
                    "type": "object",
                    "required": ["host", "state"],
                    "properties": {"host": text, "state": {"enum": ["standing by", "returning"]}},
                },
            },
            "crowded": {
                "type": "array",
                "description": "the machines whose ranks compute on their CPU and outnumber its cores, as the group "
                "last started: such ranks take turns, and each step waits on them (``advice`` says what to change)",
                "items": {
                    "type": "object",
                    "required": ["host", "hostname", "ranks", "cores", "advice"],
                    "properties": {
                        "host": text,
                        "hostname": text,
                        "ranks": {"type": "array", "items": integer},
                        "cores": integer,
                        "advice": text,
                    },
                },
            },
            "moves": {
                "type": "array",
                "description": "the ranks moved to a spare since the leader started, the latest last",
                "items": {
                    "type": "object",
                    "required": ["rank", "from", "to", "out_s", "reason", "at"],
                    "properties": {
                        "rank": integer,
                        "from": text,
                        "to": text,
                        "out_s": {"type": "number"},
                        "reason": text,
                        "at": {"type": "number"},
                    },
                },
            },
            "shrinks": {
                "type": "array",
                "description": "the times the group went on without ranks whose hosts stayed out of reach with no "
                "spare left, the model split again over the ranks that remain; the latest last",
                "items": {
                    "type": "object",
                    "required": ["ranks", "hosts", "world_size", "stages", "reason", "at"],
                    "properties": {
                        "ranks": {"type": "array", "items": integer},
                        "hosts": {"type": "array", "items": text},
                        "world_size": integer,
                        "stages": integer,
                        "reason": text,
                        "at": {"type": "number"},
                    },
                },
            },
            "now": {"type": "number", "description": "the server's clock, in unix seconds, for ``recent``"},
            "recent": {
                "description": "the last minutes' seconds that had steps: [unix second, steps, step seconds, tokens]",
                "type": "array",
                "items": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4},
            },
        },
    }
    paths = {
        "/v1/status": get(
            "the cluster: model, ranks, queue, caches, counters, losses and recoveries (the page polls it)",
            replies(401, ok=ref("Status")),
            **spec.secured,
        )
    }
    return paths, {"Status": body}
