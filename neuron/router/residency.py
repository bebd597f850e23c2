"""Which models stay resident: the decisions alone, on plain numbers, so that each is a unit test. No I/O.

A model is never unloaded under a request in flight: one that is busy is never chosen. Of the idle ones, the
least recently used goes first (llama.cpp's router and Ollama choose so).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Resident:
    """What residency knows of a loaded (or loading) model."""

    name: str
    busy: int  # requests in flight or waiting for it
    last_used: float  # when a request for it last came or ended (a monotonic clock)
    keep_alive: float | None  # seconds it may stay idle; None: until it must make room
    held: int = 0  # bytes its server's processes hold


def make_room(resident: list[Resident], wanted: str, models_max: int | None) -> list[str] | None:
    """The models to unload so that ``wanted`` may load under ``models_max``, least recently used first; None
    when too many of them are busy to make room now (the request waits for one to become idle)."""
    others = [r for r in resident if r.name != wanted]
    if models_max is None or len(others) < models_max:
        return []
    idle = sorted((r for r in others if r.busy == 0), key=lambda r: r.last_used)
    need = len(others) - models_max + 1
    return [r.name for r in idle[:need]] if len(idle) >= need else None


def expired(resident: list[Resident], now: float) -> list[str]:
    """The idle models whose ``keep_alive`` has passed."""
    return [r.name for r in resident if r.busy == 0 and r.keep_alive is not None and now - r.last_used >= r.keep_alive]


def unload_to_fit(resident: list[Resident], need: int, free: int) -> list[str] | None:
    """The idle models to unload, least recently used first, so that a model needing ``need`` bytes fits where
    ``free`` are free now: [] when it fits already, None when it cannot even with every idle model gone."""
    chosen: list[str] = []
    for r in sorted((r for r in resident if r.busy == 0), key=lambda r: r.last_used):
        if free >= need:
            break
        chosen.append(r.name)
        free += r.held
    return chosen if free >= need else None
