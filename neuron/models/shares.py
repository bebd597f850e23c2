"""A rank's share of a model, pushed to a host that lacks the model: how it is named, laid out and checked on disk.

What a rank loads is its share: its slice of every layer (tensor parallel), or
its pipeline stage's layers, plus the config and tokenizer files. The leader
sends a host exactly that (``launch/push.py``) into the host's neuron cache,
``<cache>/shares/<model digest>/<share>/``:

- ``model.safetensors``: the share's tensors, already sliced, named as in the
  whole model; its header is written first, each tensor's bytes at its place.
- ``progress.jsonl``: what has arrived, one record per chunk or tensor, so
  that a cut push resumes where it stopped: ``{"name", "bytes"}`` while a
  tensor arrives, ``{"name", "sha256"}`` once it is whole and checked.
- ``plan.json``: the contents the leader announced (``Contents``); another layout starts over.
- ``share.json``, the manifest, written last: every tensor's and file's
  sha256. A share is complete when it exists and every digest in it still
  matches the bytes on disk (checked on every start, so a changed tensor is
  found and sent again).

A host that fetches the model from the Hub itself cannot slice a file, so it
fetches the safetensors files its share's tensors lie in (``files_read``):
every file for a slice of every layer, its stage's files for a stage.

No MLX here: the worker checks a share and the receiver writes one before MLX loads.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from neuron.models.folder import safetensors_headers
from neuron.system.paths import cache_dir

SHARES = "shares"
WEIGHTS = "model.safetensors"
PROGRESS = "progress.jsonl"
CONTENTS = "plan.json"  # its name from before ``Contents`` was named so: the shares pushed then stay good
MANIFEST = "share.json"
_KEY = re.compile(r"[0-9a-f]{16}/(tp-\d+-of-\d+|pp-\d+-\d+)")
_READ = 1 << 20
INDEX = "model.safetensors.index.json"
# Checkpoints' names for the decoder (a vision-language model's language model's too): its layers, and what
# rank 0's stage alone holds besides them, the embedding, the final norm and the head (``rank.model.shard.take_share``).
# A vision or audio tower's layers go by other names, which every stage reads.
_DECODER = r"^(?:model\.|language_model\.model\.|model\.language_model\.|language_model\.)?"
_DECODER_LAYER = re.compile(_DECODER + r"layers\.(\d+)\.")
_RANK0_ONLY = re.compile(_DECODER + r"(?:embed_tokens|norm)\.|^(?:language_model\.)?lm_head\.")


class ShareError(ValueError):
    """A share that cannot be used or written; the message says which and why."""


def share_key(model_digest: str, rank: int, size: int, layers: list[int]) -> str:
    """Where a rank's share lives under the cache's ``shares``: the model's digest, then which share (a rank's
    slice of ``size``, or a stage's layers ``[first, end)``; a stage other than rank 0's holds no embedding)."""
    name = f"pp-{layers[0]}-{layers[1]}" if layers else f"tp-{rank}-of-{size}"
    return f"{model_digest}/{name}"


def tensor_files(model_path: str | Path) -> dict[str, str]:
    """Each tensor of a model folder -> the safetensors file it lies in: the index's ``weight_map``, or the files'
    own headers where there is no index (a model in one file)."""
    path = Path(model_path)
    if (path / INDEX).is_file():
        return dict(json.loads((path / INDEX).read_text())["weight_map"])
    out = {}
    for weights, header in safetensors_headers(path):
        out.update(dict.fromkeys((name for name in header if name != "__metadata__"), weights.name))
    return out


def files_read(model_path: str | Path, layers: list[int], rank: int) -> list[str]:
    """The safetensors files of a model folder that ``rank`` loads from: every one for a slice of every layer
    (``layers`` empty); for a pipeline stage ``[first, end)``, those holding its layers and the tensors outside
    the layers it keeps: on rank 0 the embedding, final norm and head; on every stage all else (gemma4's
    per-layer tables and the embedding they are computed from, a vision tower). Where in doubt a file is read: one
    missed fails the stage's load."""
    where = tensor_files(model_path)
    if not layers:
        return sorted(set(where.values()))
    first, end = layers
    per_layer_inputs = any("per_layer" in name for name in where)

    def read(name: str) -> bool:
        if layer := _DECODER_LAYER.match(name):
            return first <= int(layer[1]) < end
        return rank == 0 or not _RANK0_ONLY.match(name) or (per_layer_inputs and "embed_tokens." in name)

    return sorted({file for name, file in where.items() if read(name)})


def folder(key: str) -> Path:
    if not _KEY.fullmatch(key):
        raise ShareError(f"{key!r} does not name a share (digest/tp-R-of-N or digest/pp-FIRST-END)")
    return cache_dir() / SHARES / key


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a share, as its safetensors header describes it."""

    name: str
    dtype: str  # safetensors' name: F32, BF16, U32...
    shape: list[int]
    size: int  # bytes
    whole: list[int]  # its shape in the whole model, before a rank's slice was cut (the loader asks)


@dataclass(frozen=True, slots=True)
class Contents:
    """What the leader sends a host: the share's tensors (in file order) and its other files' digests."""

    key: str
    entries: list[Entry]
    files: dict[str, str]  # config and tokenizer files -> sha256

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Contents:
        return cls(raw["key"], [Entry(**e) for e in raw["entries"]], dict(raw["files"]))


def layout(entries: list[Entry]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The safetensors header for ``entries`` (in their order), and each tensor's ``[begin, end)`` in the file."""
    header: dict[str, Any] = {}
    position = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": entry.dtype,
            "shape": entry.shape,
            "data_offsets": [position, position + entry.size],
        }
        position += entry.size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writers leave it
    prefix = len(raw).to_bytes(8, "little") + raw
    start = len(prefix)
    return prefix, {name: (start + o["data_offsets"][0], start + o["data_offsets"][1]) for name, o in header.items()}


def sha256_of(path: Path, begin: int = 0, end: int | None = None) -> str:
    """The sha256 of ``path``'s bytes ``[begin, end)`` (to its end when None)."""
    return sha256_from(path, begin, end).hexdigest()


def sha256_from(path: Path, begin: int = 0, end: int | None = None) -> hashlib._Hash:
    """A sha256 fed with ``path``'s bytes ``[begin, end)``, to be fed more."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(begin)
        left = (end - begin) if end is not None else None
        while left is None or left > 0:
            chunk = f.read(_READ if left is None else min(_READ, left))
            if not chunk:
                break
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)
    return digest


def read_progress(where: Path) -> tuple[dict[str, str], dict[str, int]]:
    """From ``progress.jsonl``: the tensors recorded whole (name -> sha256) and those partly arrived (name -> bytes
    written). The last record of a name wins; a torn last line (a cut mid-write) is ignored."""
    whole: dict[str, str] = {}
    partial: dict[str, int] = {}
    try:
        lines = (where / PROGRESS).read_text().splitlines()
    except FileNotFoundError:
        return whole, partial
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        name = record["name"]
        if "sha256" in record:
            whole[name] = record["sha256"]
            partial.pop(name, None)
        else:
            partial[name] = int(record["bytes"])
            whole.pop(name, None)
    return whole, partial


def held(where: Path, contents: Contents) -> tuple[set[str], dict[str, int]]:
    """What ``where`` already holds of ``contents``: the tensors and files whose bytes on disk match their recorded
    digests, and the tensors partly arrived (name -> bytes to resume from). A folder laid out for other contents, or
    none, holds nothing."""
    try:
        same = Contents.from_json(json.loads((where / CONTENTS).read_text())) == contents
    except (OSError, ValueError, KeyError, TypeError):
        same = False
    if not same:
        return set(), {}
    _, offsets = layout(contents.entries)
    whole, partial = read_progress(where)
    have = {
        name
        for name, digest in whole.items()
        if name in offsets and (where / WEIGHTS).is_file() and sha256_of(where / WEIGHTS, *offsets[name]) == digest
    }
    have |= {
        name
        for name, digest in contents.files.items()
        if (where / name).is_file() and sha256_of(where / name) == digest
    }
    resume = {name: n for name, n in partial.items() if name in offsets and 0 < n < offsets[name][1] - offsets[name][0]}
    return have, resume


def start_over(where: Path, contents: Contents) -> None:
    """Empty ``where`` and lay it out for ``contents``: the header written, the data's room reserved (sparse)."""
    if where.exists():
        shutil.rmtree(where)
    where.mkdir(parents=True)
    prefix, offsets = layout(contents.entries)
    with (where / WEIGHTS).open("wb") as f:
        f.write(prefix)
        f.truncate(max((end for _, end in offsets.values()), default=len(prefix)))
    (where / CONTENTS).write_text(json.dumps(contents.to_json()))


def seal(where: Path, contents: Contents) -> str:
    """Check every tensor and file against its digest and write the manifest; returns the share's digest.
    Raises ``ShareError`` naming the first that does not match."""
    whole, _ = read_progress(where)
    _, offsets = layout(contents.entries)
    tensors = {}
    for name, (begin, end) in offsets.items():
        if whole.get(name) is None or sha256_of(where / WEIGHTS, begin, end) != whole[name]:
            raise ShareError(f"{where}: tensor {name} did not arrive whole (its sha256 does not match the leader's)")
        tensors[name] = whole[name]
    for name, digest in contents.files.items():
        if sha256_of(where / name) != digest:
            raise ShareError(f"{where}: {name} did not arrive whole (its sha256 does not match the leader's)")
    manifest = {"key": contents.key, "tensors": tensors, "files": contents.files}
    manifest["digest"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    (where / MANIFEST).write_text(json.dumps(manifest))
    return str(manifest["digest"])


def intact(where: Path) -> bool:
    """Whether ``where`` holds a complete share whose every tensor and file still matches its manifest."""
    try:
        manifest = json.loads((where / MANIFEST).read_text())
        contents = Contents.from_json(json.loads((where / CONTENTS).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return False
    _, offsets = layout(contents.entries)
    if set(offsets) != set(manifest["tensors"]) or not (where / WEIGHTS).is_file():
        return False
    if any(sha256_of(where / WEIGHTS, *offsets[n]) != digest for n, digest in manifest["tensors"].items()):
        return False
    return all((where / n).is_file() and sha256_of(where / n) == digest for n, digest in manifest["files"].items())


def whole_shapes(where: Path) -> dict[str, list[int]]:
    """Each tensor of the share at ``where`` -> its shape in the whole model."""
    return {e.name: e.whole for e in Contents.from_json(json.loads((where / CONTENTS).read_text())).entries}


def is_share(model_path: str | Path) -> bool:
    """Whether a model folder is a pushed share (its tensors already sliced for one rank), not a whole model."""
    return (Path(model_path) / MANIFEST).is_file()
