"""Why the server cannot generate yet, as the probes and the status route both say it, and each rank's state, as
the status and the hosts' routes both give it. No MLX."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neuron.server.http import ServerState


def not_ready_because(state: ServerState) -> str | None:
    """Why the server is not ready to generate, or None when it is."""
    engine = state.engine
    if engine is None:
        return state.status
    if not engine.accepting:
        return "shutting down"
    return None if engine.health.ready else engine.health.reason


def rank_state(rank: int, failures: dict[int, str] | None, loaded: bool) -> tuple[str, str | None]:
    """A rank's state and why: ``lost`` where the broken group names it, ``starting`` while the group is broken
    by another rank or (re)loading the model, else ``ok``."""
    if failures is not None and rank in failures:
        return "lost", failures[rank]
    if failures is not None or not loaded:
        return "starting", None
    return "ok", None
