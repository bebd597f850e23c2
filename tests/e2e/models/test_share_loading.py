"""A share of the model as the leader cuts it for another rank, streamed into a cache as a host receives it, then
loaded as that rank loads it: the same parameters, to the bit, as the rank's own cut of the whole model. Without
SSH or a group (``Slot`` stands for the rank's place in it), for a plain and a quantized model."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

from neuron.launch import push
from neuron.models import shares
from neuron.models.folder import ModelError
from neuron.rank.model.share import ShareSource, Slot, _load_share, load_stage, take_share
from testkit import file_per_layer


@pytest.fixture(scope="module")
def quantized(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("quantized") / "qwen3-4bit"
    model, config = load_model(tiny_models["qwen3"])
    model, config = quantize_model(model, config, group_size=64, bits=4)
    folder.mkdir()
    save_model(folder, model)
    save_config(config, folder / "config.json")
    for tokenizer in tiny_models["qwen3"].glob("tokenizer*"):
        shutil.copy(tokenizer, folder)
    return folder


def received(model: Path, rank: int, size: int, layers: list[int]) -> Path:
    """The share the leader would push to ``rank``, received into this process's cache."""
    source = ShareSource(model, rank, size, layers)
    config = (model / "config.json").read_bytes()
    contents = shares.Contents(
        shares.share_key("0123456789abcdef", rank, size, layers),
        source.entries(),
        {"config.json": hashlib.sha256(config).hexdigest()},
    )
    stream = b""
    for entry in contents.entries:
        data = source.data(entry.name).cast("B")
        line = {"tensor": entry.name, "offset": 0, "sha256": hashlib.sha256(data).hexdigest()}
        stream += json.dumps(line).encode() + b"\n" + bytes(data)
    stream += json.dumps({"file": "config.json", "size": len(config)}).encode() + b"\n" + config + b'{"end": true}\n'
    where = shares.folder(contents.key)
    shares.start_over(where, contents)
    assert push.receive(io.BytesIO(stream), where, contents)
    shares.seal(where, contents)
    return where


@pytest.mark.parametrize(("rank", "size", "layers"), [(1, 2, []), (1, 2, [1, 4])], ids=["tp", "pp"])
@pytest.mark.parametrize("which", ["plain", "quantized"])
def test_a_pushed_share_loads_as_the_ranks_own_cut_of_the_whole_model(
    tiny_models: dict[str, Path],
    quantized: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    which: str,
    rank: int,
    size: int,
    layers: list[int],
) -> None:
    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path))
    model = tiny_models["qwen3"] if which == "plain" else quantized
    group = Slot(rank, size) if not layers else None
    share = received(model, rank, size, layers)
    loaded = dict(tree_flatten(_load_share(share, group, layers, rank).parameters()))  # type: ignore[arg-type]
    whole, config = load_model(model, lazy=True)
    take_share(whole, config, group, layers, rank)
    expected = dict(tree_flatten(whole.parameters()))
    assert loaded.keys() == expected.keys()
    assert all(mx.array_equal(loaded[k], expected[k]).item() for k in loaded)
    sent = sum(e["size"] for e in json.loads((share / shares.CONTENTS).read_text())["entries"])
    assert sent == sum(v.nbytes for v in expected.values()) < (model / "model.safetensors").stat().st_size


@pytest.mark.parametrize("which", ["plain", "quantized"])
def test_a_stage_loads_from_the_files_its_layers_lie_in_as_from_the_whole_model(
    tiny_models: dict[str, Path], quantized: Path, tmp_path: Path, which: str
) -> None:
    """What a host fetching a stage from the Hub holds (``shares.files_read``): the same parameters as a cut of
    the whole model, and a file missing refused by the tensor it lacks."""
    model = file_per_layer(tiny_models["qwen3"] if which == "plain" else quantized, tmp_path / "sharded")
    for rank, layers in ((0, [0, 2]), (1, [2, 3])):
        read = shares.files_read(model, layers, rank)
        partial = tmp_path / f"rank{rank}"
        shutil.copytree(model, partial, ignore=shutil.ignore_patterns("*.safetensors"))
        for name in read:
            (partial / name).symlink_to(model / name)  # as a Hugging Face snapshot links its blobs
        assert len(list(partial.glob("*.safetensors"))) < len(list(model.glob("*.safetensors")))
        loaded = dict(tree_flatten(load_stage(partial, *layers, rank).parameters()))
        expected = dict(tree_flatten(load_stage(model, *layers, rank).parameters()))
        assert loaded.keys() == expected.keys()
        assert all(mx.array_equal(loaded[k], expected[k]).item() for k in loaded)
    (partial / read[0]).unlink()
    with pytest.raises(ModelError, match=r"lacks model\.layers\.2\..*stage of layers \[2, 3\)"):
        load_stage(partial, 2, 3, 1)
