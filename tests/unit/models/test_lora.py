"""LoRA adapters (issue 47), the decisions: adapter lists and configs read or refused with the reason, and a prefix
cache whose entries are never shared across adapters. Served adapters against mlx-lm's: tests/e2e/models/
test_lora.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron.engine.prefix import PrefixIndex
from neuron.models.adapters import AdapterError, find, parse_list


def test_adapter_lists_and_configs_are_read_or_refused_with_the_reason(tmp_path: Path) -> None:
    assert parse_list("sql=/a, chat=org/chat-lora") == [("sql", "/a"), ("chat", "org/chat-lora")]
    for bad, why in (("sql", "is not NAME=PATH"), ("a=/x,a=/y", "names 'a' twice"), ("/x=/y", "must start")):
        with pytest.raises(AdapterError, match=why):
            parse_list(bad)
    folder = tmp_path / "peft"
    folder.mkdir()
    with pytest.raises(AdapterError, match=r"has no adapter_config\.json"):
        find("x", str(folder))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "use_rslora": True}))
    with pytest.raises(AdapterError, match=r"has neither adapters\.safetensors"):
        find("x", str(folder))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    spec = find("x", str(folder))
    assert (spec.format, spec.rank, spec.scale) == ("peft", 8, 16 / 8**0.5)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "use_dora": True}))
    with pytest.raises(AdapterError, match="with DoRA"):
        find("x", str(folder))
    mlx = tmp_path / "mlx"
    mlx.mkdir()
    (mlx / "adapters.safetensors").write_bytes(b"")
    (mlx / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "dora"}))
    with pytest.raises(AdapterError, match="only LoRA adapters"):
        find("x", str(mlx))
    (mlx / "adapter_config.json").write_text(json.dumps({"lora_parameters": {"rank": 4, "scale": 20.0}}))
    assert find("x", str(mlx)).scale == 20.0


def test_the_prefix_cache_never_shares_an_entry_across_adapters() -> None:
    index = PrefixIndex(8, 1)  # room for two entries of four tokens
    adapted = index.store([1, 2, 3, 4], adapter=1)
    assert adapted is not None
    assert index.lookup([1, 2, 3, 4, 5]) is None and index.lookup([1, 2, 3, 4, 5], adapter=2) is None
    hit = index.lookup([1, 2, 3, 4, 5], adapter=1)
    assert hit is not None and hit.entry == adapted.entry
    index.unpin()
    base = index.store([1, 2, 3, 4])  # the same tokens under the base model: an entry of its own
    assert base is not None and base.entry != adapted.entry and not base.evicted
    other = index.store([1, 2, 3, 4], adapter=2)  # the least recently used (adapter 1's) goes from its own trie
    assert other is not None and other.evicted == [adapted.entry]
    assert index.lookup([1, 2, 3, 4, 5], adapter=1) is None
    assert (index.lookup([1, 2, 3, 4, 5]) or base).entry == base.entry != other.entry
