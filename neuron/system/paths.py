"""Where neuron keeps what it makes once and reuses: converted models, native helpers built for this machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``NEURON_CACHE_DIR``, else systemd's ``CacheDirectory=``, else the XDG cache."""
    if explicit := os.environ.get("NEURON_CACHE_DIR"):
        return Path(explicit)
    if systemd := os.environ.get("CACHE_DIRECTORY"):
        return Path(systemd.split(":")[0])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "neuron"
