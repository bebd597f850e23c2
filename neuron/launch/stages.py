"""How a model's layers are split into pipeline stages, one per rank: by each host's free memory, or as asked.

Rank 0 holds, besides its layers, the embedding, the final norm and the head
(it samples), so its room for layers is its free memory less those. Each
stage gets a share of the layers in proportion to its room, rounded by the
largest remainder, at least one each, then moved where a stage would part two
layers that must stay together (``architectures.kept_together``: gemma4's
layers reading another's keys and values). No MLX here: the leader decides, from
the handshake's free memory and the weights' headers, before any rank loads.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from neuron import metrics
from neuron.models import architectures
from neuron.models.folder import read_config, text_config, weight_bytes

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


def check_split(counts: list[int], layers: int, stages: int, together: Sequence[tuple[int, int]] = ()) -> None:
    """Refuse an operator's split (``counts``) that does not cover the model, or that parts two layers kept
    ``together`` ((source, reader) pairs), naming them and a split that keeps them; without one asked, refuse
    ``stages`` that no split can give without parting such a pair."""
    if not counts:
        if keep_together([1] * (stages - 1) + [layers - stages + 1], together) is None:
            pairs = ", ".join(f"{reader} reads {source}'s" for source, reader in together)
            raise SplitError(
                f"the model's layers read earlier layers' keys and values ({pairs}), and no split into {stages} "
                "stages puts each pair in one stage; use a smaller --pp"
            )
        return
    asked = ",".join(map(str, counts))
    if len(counts) != stages or sum(counts) != layers:
        raise SplitError(f"--pp-layers {asked} must name {stages} stages whose layers add up to the model's {layers}")
    stage_of = [rank for rank, count in enumerate(counts) for _ in range(count)]
    for source, reader in together:
        if stage_of[source] != stage_of[reader]:
            kept = keep_together(counts, together)
            instead = f"use --pp-layers {','.join(map(str, kept))}" if kept else f"no split into {stages} stages does"
            raise SplitError(
                f"--pp-layers {asked} puts layer {reader} in stage {stage_of[reader]} and layer {source}, whose keys "
                f"and values it reads, in stage {stage_of[source]}: one stage must hold both; {instead}"
            )


def keep_together(counts: list[int], together: Sequence[tuple[int, int]]) -> list[int] | None:
    """``counts`` with each boundary between stages moved to the nearest one that parts no pair kept ``together``
    ((source, reader): a stage starting after the source and at or before the reader parts them), every stage
    keeping at least one layer; None where no such split exists."""
    layers, cuts = sum(counts), len(counts) - 1
    allowed = [b for b in range(1, layers) if not any(source < b <= reader for source, reader in together)]
    chosen: list[int] = []
    wanted = 0
    for k, count in enumerate(counts[:-1]):
        wanted += count
        # Leave room for the cuts still to place after this one.
        open_ = [i for i, b in enumerate(allowed) if (not chosen or b > chosen[-1]) and len(allowed) - i > cuts - k - 1]
        if not open_:
            return None
        chosen.append(allowed[min(open_, key=lambda i: abs(allowed[i] - wanted))])
    bounds = [0, *chosen, layers]
    return [bounds[i + 1] - bounds[i] for i in range(len(counts))]


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


def by_memory(model_path: str, free: list[int]) -> list[int]:
    """Layers per stage in proportion to each rank's free memory (``split_by_memory``), with the layers the
    architecture keeps together in one stage."""
    config = read_config(model_path)
    per_layer, rest = weight_bytes(model_path, int(text_config(config)["num_hidden_layers"]))
    kept = keep_together(split_by_memory(per_layer, rest, free), architectures.kept_together(config))
    if kept is None:  # check_split refuses this before any rank is spawned
        raise SplitError(f"no split of the model into {len(free)} stages keeps together the layers that must be")
    return kept


def plan_stages(model_path: str, asked: list[int], free: list[int], hosts: list[str]) -> list[tuple[int, int]]:
    """Each stage's ``[first, end)``: as asked (``--pp-layers``), else by each rank's free memory; logged and
    shown in ``/metrics``, so an operator sees where the layers went."""
    counts = asked or by_memory(model_path, free)  # as asked: checked against the model before any rank was spawned
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
