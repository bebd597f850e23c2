"""Pushing a share of the model (--push-model), its decisions alone: the share's layout on disk, what a host holds
of it after a cut or a change, what is left to send, and whether it fits. No MLX, no process."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest

from neuron.cli.main import _parser
from neuron.config import sources
from neuron.launch import push
from neuron.launch.checks import Refused, check_models, model_differences
from neuron.models import shares
from neuron.rpc import ModelChecked

TENSORS = {"a.weight": bytes(range(256)) * 40, "b.weight": b"\x07" * 3000, "c.bias": b"\x01\x02" * 10}
CONFIG = b'{"model_type": "llama"}'


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path))
    return tmp_path


def contents() -> shares.Contents:
    entries = [shares.Entry(name, "U8", [len(data)], len(data), [2 * len(data)]) for name, data in TENSORS.items()]
    return shares.Contents("0123456789abcdef/tp-1-of-2", entries, {"config.json": hashlib.sha256(CONFIG).hexdigest()})


def stream(names: list[str], offsets: dict[str, int] | None = None, files: bool = True, end: bool = True) -> bytes:
    """What the leader sends for ``names`` (each from its offset), then the config, then the end."""
    out = b""
    for name in names:
        start = (offsets or {}).get(name, 0)
        digest = hashlib.sha256(TENSORS[name]).hexdigest()
        out += json.dumps({"tensor": name, "offset": start, "sha256": digest}).encode() + b"\n" + TENSORS[name][start:]
    if files:
        out += json.dumps({"file": "config.json", "size": len(CONFIG)}).encode() + b"\n" + CONFIG
    return out + (b'{"end": true}\n' if end else b"")


def test_the_layout_is_a_safetensors_file_with_its_data_aligned() -> None:
    prefix, offsets = shares.layout(contents().entries)
    header_length = int.from_bytes(prefix[:8], "little")
    header = json.loads(prefix[8:])
    assert len(prefix) % 8 == 0 and header_length == len(prefix) - 8
    assert offsets["a.weight"] == (len(prefix), len(prefix) + 10240)
    assert offsets["b.weight"][0] == offsets["a.weight"][1] and header["c.bias"]["data_offsets"] == [13240, 13260]


def test_a_cut_push_resumes_inside_the_tensor_it_stopped_in_and_seals_whole(cache: Path) -> None:
    share = contents()
    where = shares.folder(share.key)
    shares.start_over(where, share)
    whole = stream(list(TENSORS))
    first_header = whole.index(b"\n") + 1
    cut = whole[: first_header + 10240 + whole[first_header + 10240 :].index(b"\n") + 1 + 1000]  # 1000 bytes of b
    with pytest.raises(push.PushCut, match=r"ended inside tensor b\.weight"):
        push.receive(io.BytesIO(cut), where, share)
    have, resume = shares.held(where, share)
    assert have == {"a.weight"} and resume == {"b.weight": 1000}
    assert not shares.intact(where)
    assert push.needed_bytes(share, {"config.json": _config(where.parent)}, have, resume) == 2000 + 20 + len(CONFIG)
    assert push.receive(io.BytesIO(stream(["b.weight", "c.bias"], resume)), where, share)
    shares.seal(where, share)
    assert shares.intact(where) and shares.is_share(where)
    data = (where / shares.WEIGHTS).read_bytes()
    for name, (begin, end) in shares.layout(share.entries)[1].items():
        assert data[begin:end] == TENSORS[name]


def test_a_changed_tensor_is_no_longer_held_and_the_rest_is(cache: Path) -> None:
    share = contents()
    where = shares.folder(share.key)
    shares.start_over(where, share)
    assert push.receive(io.BytesIO(stream(list(TENSORS))), where, share)
    shares.seal(where, share)
    _, end = shares.layout(share.entries)[1]["b.weight"]
    with (where / shares.WEIGHTS).open("r+b") as f:
        f.seek(end - 1)  # the last byte: a sampled digest of the first bytes would not see it
        f.write(b"\x00")
    assert not shares.intact(where)
    assert shares.held(where, share) == ({"a.weight", "c.bias", "config.json"}, {})


def test_a_folder_laid_out_for_another_plan_holds_nothing(cache: Path) -> None:
    share = contents()
    where = shares.folder(share.key)
    shares.start_over(where, share)
    assert push.receive(io.BytesIO(stream(list(TENSORS))), where, share)
    other = shares.Contents(share.key, share.entries[:2], share.files)
    assert shares.held(where, other) == (set(), {})


def test_a_tensor_that_arrives_wrong_is_refused_and_not_counted(cache: Path) -> None:
    share = contents()
    where = shares.folder(share.key)
    shares.start_over(where, share)
    bad = stream(["c.bias"]).replace(b"\x01\x02" * 10, b"\x02\x01" * 10)
    with pytest.raises(shares.ShareError, match=r"c\.bias arrived with another sha256"):
        push.receive(io.BytesIO(bad), where, share)
    assert shares.held(where, share) == (set(), {})
    with pytest.raises(shares.ShareError, match="did not arrive whole"):
        shares.seal(where, share)


def test_a_share_key_is_checked_before_it_names_a_folder(cache: Path) -> None:
    assert shares.share_key("0123456789abcdef", 1, 2, []) == "0123456789abcdef/tp-1-of-2"
    assert shares.folder(shares.share_key("0123456789abcdef", 1, 2, [4, 8])) == cache / "shares/0123456789abcdef/pp-4-8"
    with pytest.raises(shares.ShareError, match="does not name a share"):
        shares.folder("0123456789abcdef/../../etc")


def test_the_room_on_the_host_is_checked_naming_host_needed_and_free() -> None:
    assert push.room_problem("me@mac2", "/cache/x", 100, 100) is None
    problem = push.room_problem("me@mac2", "/cache/x", 5_000_000, 1_000)
    assert problem is not None and all(w in problem for w in ("me@mac2", "5000000", "1000 bytes free", "/cache/x"))


def test_without_the_setting_the_refusal_names_it() -> None:
    checked = {0: ModelChecked(0, "/m", {"config.json": "a"}), 1: ModelChecked(0, "/nowhere", {})}
    with pytest.raises(Refused, match=r"lacks config\.json.*--push-model"):
        check_models(checked, ["localhost", "mac2"])


# A checkpoint's tensors, one layer to a file as on the Hub, with what only rank 0's stage holds in the first file
# and what every stage holds (a vision tower, whose layers are not the decoder's) in the last.
WEIGHT_MAP = {
    "model.embed_tokens.weight": "model-1.safetensors",
    "model.norm.weight": "model-1.safetensors",
    "lm_head.weight": "model-1.safetensors",
    **{f"model.layers.{i}.mlp.down_proj.weight": f"model-{i + 2}.safetensors" for i in range(4)},
    "vision_tower.encoder.layers.0.attn.weight": "model-6.safetensors",
}


@pytest.mark.parametrize(
    ("layers", "rank", "read"),
    [
        ([], 1, [f"model-{i}.safetensors" for i in range(1, 7)]),  # a slice of every layer: every file
        ([0, 2], 0, ["model-1.safetensors", "model-2.safetensors", "model-3.safetensors", "model-6.safetensors"]),
        ([2, 3], 1, ["model-4.safetensors", "model-6.safetensors"]),
        ([3, 4], 2, ["model-5.safetensors", "model-6.safetensors"]),
    ],
)
def test_a_stage_reads_the_files_its_layers_lie_in(
    tmp_path: Path, layers: list[int], rank: int, read: list[str]
) -> None:
    (tmp_path / shares.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": WEIGHT_MAP}))
    assert shares.files_read(tmp_path, layers, rank) == read


def test_a_stage_of_a_model_with_per_layer_inputs_reads_the_embedding(tmp_path: Path) -> None:
    weight_map = {**WEIGHT_MAP, "model.embed_tokens_per_layer.weight": "model-7.safetensors"}
    (tmp_path / shares.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert "model-1.safetensors" in shares.files_read(tmp_path, [2, 3], 1)
    assert "model-7.safetensors" in shares.files_read(tmp_path, [2, 3], 1)


def test_a_model_in_one_file_without_an_index_is_read_whole(tmp_path: Path) -> None:
    header = json.dumps({"a.weight": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    assert shares.files_read(tmp_path, [1, 2], 1) == ["model.safetensors"]


def test_a_stage_is_compared_on_the_files_it_reads() -> None:
    leader = {"config.json": "c", "model-1.safetensors": "1", "model-4.safetensors": "4"}
    checked = {
        0: ModelChecked(0, "/m", leader),
        1: ModelChecked(0, "/hf/snapshot", {"config.json": "c", "model-4.safetensors": "4"}),
        2: ModelChecked(0, "/hf/other", {"config.json": "c", "model-4.safetensors": "changed"}),
    }
    reads = [["model-1.safetensors", "model-4.safetensors"], ["model-4.safetensors"], ["model-4.safetensors"]]
    assert list(model_differences(checked, ["localhost", "mac2", "mac3"], reads)) == [2]
    assert list(model_differences(checked, ["localhost", "mac2", "mac3"])) == [1, 2]  # every file, without reads


def test_push_model_is_a_setting_like_every_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def resolve(*argv: str) -> tuple[object, list[str]]:
        args = _parser().parse_args(["serve", *argv])
        problems = sources.resolve(args, "serve")
        return args.push_model, problems

    file = tmp_path / "neuron.toml"
    file.write_text("push_model = true\n")
    monkeypatch.delenv("NEURON_PUSH_MODEL", raising=False)
    assert resolve("--config", str(file)) == (True, [])
    file.write_text("")
    assert resolve("--config", str(file)) == (False, [])
    assert resolve("--config", str(file), "--push-model") == (True, [])
    monkeypatch.setenv("NEURON_PUSH_MODEL", "off")
    assert resolve("--config", str(file)) == (False, [])
    monkeypatch.setenv("NEURON_PUSH_MODEL", "maybe")
    assert resolve("--config", str(file))[1] == ["NEURON_PUSH_MODEL must be true or false (1 or 0), got 'maybe'"]


def _config(root: Path) -> Path:
    path = root / "config.json"
    path.write_bytes(CONFIG)
    return path
