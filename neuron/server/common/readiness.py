"""Why the server cannot generate yet, as the probes and the status route both say it. No MLX."""

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
