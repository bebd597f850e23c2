"""How a model's layers are split into pipeline stages, one per rank: by each host's free memory, or as asked.

Rank 0 holds, besides its layers, the embedding, the final norm and the head
(it samples), so its room for layers is its free memory less those. Each
stage gets a share of the layers in proportion to its room, rounded by the
largest remainder, at least one each. No MLX here: the leader decides, from
the handshake's free memory and the weights' headers, before any rank loads.
"""

from __future__ import annotations

import structlog

from neuron import metrics
from neuron.models import read_config, text_config, weight_bytes

log = structlog.get_logger("neuron.pool")


class SplitError(ValueError):
    """A split that cannot be used; the message says which."""


def parse_split(text: str) -> list[int]:
    """``--pp-layers 10,20``: layers per stage, in rank order."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise SplitError(f"--pp-layers must be layer counts per stage, like 10,20; got {text!r}") from None
    if any(c < 1 for c in counts):
        raise SplitError(f"--pp-layers gives every stage at least one layer; got {text!r}")
    return counts


def check_split(counts: list[int], layers: int, stages: int) -> None:
    if len(counts) != stages or sum(counts) != layers:
        raise SplitError(
            f"--pp-layers {','.join(map(str, counts))} must name {stages} stages whose layers add up to the "
            f"model's {layers}"
        )


def split_by_memory(per_layer: list[int], rest: int, free: list[int]) -> list[int]:
    """Layers per stage in proportion to each rank's room (rank 0's free memory less ``rest``), at least one each."""
    stages, layers = len(free), len(per_layer)
    room = [max(f - (rest if r == 0 else 0), 0) for r, f in enumerate(free)]
    total = sum(room)
    shares = [layers * r / total for r in room] if total else [layers / stages] * stages
    counts = [max(1, int(s)) for s in shares]
    # Largest remainder: the stages whose share lost most to rounding get the layers left (or give back extras).
    order = sorted(range(stages), key=lambda r: shares[r] - int(shares[r]), reverse=True)
    i = 0
    while sum(counts) < layers:
        counts[order[i % stages]] += 1
        i += 1
    while sum(counts) > layers:
        widest = max((r for r in range(stages) if counts[r] > 1), key=lambda r: counts[r] - shares[r])
        counts[widest] -= 1
    return counts


def ranges(counts: list[int]) -> list[tuple[int, int]]:
    """Each stage's ``[first, end)``, in rank order."""
    out, first = [], 0
    for count in counts:
        out.append((first, first + count))
        first += count
    return out


def plan_stages(model_path: str, asked: list[int], free: list[int], hosts: list[str]) -> list[tuple[int, int]]:
    """Each stage's ``[first, end)``: as asked (``--pp-layers``), else by each rank's free memory; logged and
    shown in ``/metrics``, so an operator sees where the layers went."""
    if asked:  # checked against the model before any rank was spawned
        counts = asked
    else:
        per_layer, rest = weight_bytes(model_path, int(text_config(read_config(model_path))["num_hidden_layers"]))
        counts = split_by_memory(per_layer, rest, free)
    log.info("pipeline split", layers=counts, hosts=hosts, by="asked" if asked else "free memory")
    for rank, count in enumerate(counts):
        metrics.STAGE_LAYERS.labels(str(rank), hosts[rank]).set(count)
    return ranges(counts)


def weights_per_rank(model_path: str, world_size: int, stages: list[tuple[int, int]]) -> list[int]:
    """Bytes of the model's weights each rank will hold, from the headers: in a pipeline (``stages``, each
    rank's ``[first, end)``) its layers, and on rank 0 the embedding, final norm and head; split tensor-parallel,
    its share of every layer (``shard()`` splits the layers' matrices evenly) and the rest whole (replicated)."""
    per_layer, rest = weight_bytes(model_path, int(text_config(read_config(model_path))["num_hidden_layers"]))
    if stages:
        return [sum(per_layer[first:end]) + (rest if rank == 0 else 0) for rank, (first, end) in enumerate(stages)]
    return [-(-sum(per_layer) // world_size) + rest] * world_size
