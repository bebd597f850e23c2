"""LoRA adapters as files: ``--adapter NAME=PATH`` read, a folder (or a Hub name) found, its format told apart and
its config checked, before any rank is asked to load it. No MLX: the leader checks here, each rank reads the
tensors (``rank.model.lora``).

Two formats, each an ``adapter_config.json`` beside one safetensors file:

- mlx-lm's (``mlx_lm.lora`` writes it): ``adapters.safetensors``, each projection's ``lora_a`` (inputs x rank) and
  ``lora_b`` (rank x outputs), scaled by ``lora_parameters.scale``;
- PEFT's: ``adapter_model.safetensors``, each projection's ``lora_A.weight`` (rank x inputs) and ``lora_B.weight``
  (outputs x rank), scaled by ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron.models import hub

MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
FILES = (CONFIG, MLX_WEIGHTS, PEFT_WEIGHTS)

# A name a client can send as ``model``, and that cannot be taken for a path or a Hub name's parts.
_NAME = re.compile(r"^[A-Za-z0-9][\w.:-]{0,127}$")


class AdapterError(ValueError):
    """An adapter that cannot be served as given; the message says which and what to do."""


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """An adapter found and its config read: where its tensors are, in which format, and how they scale."""

    name: str
    path: Path  # the folder
    format: str  # "mlx" or "peft"
    rank: int
    scale: float

    @property
    def weights(self) -> Path:
        return self.path / (MLX_WEIGHTS if self.format == "mlx" else PEFT_WEIGHTS)


def parse_list(value: str | None) -> list[tuple[str, str]]:
    """``NAME=PATH`` pairs, comma-separated (the repeated flag's values joined, or the setting's); each name once."""
    pairs: list[tuple[str, str]] = []
    for item in (value or "").split(","):
        if not item.strip():
            continue
        name, sep, where = item.strip().partition("=")
        if not sep or not where.strip():
            raise AdapterError(f"--adapter {item.strip()!r} is not NAME=PATH; e.g. --adapter sql=/models/sql-lora")
        check_name(name.strip())
        if any(name.strip() == other for other, _ in pairs):
            raise AdapterError(f"--adapter names {name.strip()!r} twice; give each adapter a name of its own")
        pairs.append((name.strip(), where.strip()))
    return pairs


def check_name(name: str) -> None:
    if not _NAME.match(name):
        raise AdapterError(
            f"adapter name {name!r} must start with a letter or digit and hold only letters, digits and . _ - :"
        )


def find(name: str, where: str) -> AdapterSpec:
    """The adapter ``name`` at ``where`` (a folder, or a Hub name fetched into the Hugging Face cache), its config
    read and checked; ``AdapterError`` saying why not."""
    check_name(name)
    hub_name = hub.parse(where)
    try:
        folder = hub.fetch_adapter(hub_name) if hub_name is not None else Path(where).expanduser()
    except hub.HubError as e:
        raise AdapterError(f"adapter {name!r}: {e}") from None
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {folder} is not a folder; give the folder holding {CONFIG}")
    config_file = folder / CONFIG
    if not config_file.is_file():
        raise AdapterError(f"adapter {name!r}: {folder} has no {CONFIG}; an mlx-lm or PEFT LoRA adapter has one")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: cannot read {config_file}: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {config_file} is not a JSON object")
    if (folder / MLX_WEIGHTS).is_file():
        rank, scale = _mlx(name, config)
        return AdapterSpec(name, folder.resolve(), "mlx", rank, scale)
    if (folder / PEFT_WEIGHTS).is_file():
        rank, scale = _peft(name, config)
        return AdapterSpec(name, folder.resolve(), "peft", rank, scale)
    raise AdapterError(
        f"adapter {name!r}: {folder} has neither {MLX_WEIGHTS} (mlx-lm's) nor {PEFT_WEIGHTS} (PEFT's); "
        "convert a .bin adapter to safetensors"
    )


def _mlx(name: str, config: dict[str, Any]) -> tuple[int, float]:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(f"adapter {name!r} is a {kind!r} fine-tune; only LoRA adapters can be served (not DoRA)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or not _positive_int(params.get("rank")) or not _number(params.get("scale")):
        raise AdapterError(f"adapter {name!r}: {CONFIG} needs lora_parameters with an integer rank and a scale")
    return int(params["rank"]), float(params["scale"])


def _peft(name: str, config: dict[str, Any]) -> tuple[int, float]:
    kind = config.get("peft_type", "LORA")
    if kind != "LORA" or config.get("use_dora"):
        raise AdapterError(f"adapter {name!r} is a PEFT {kind} adapter{' with DoRA' if config.get('use_dora') else ''}")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"adapter {name!r} sets rank_pattern or alpha_pattern: one rank for every projection only")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or not _positive_int(rank) or not isinstance(alpha, int | float) or not _number(alpha):
        raise AdapterError(f"adapter {name!r}: {CONFIG} needs an integer r and a number lora_alpha")
    scale = float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return rank, scale


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
