"""``neuron pull``, ``neuron models`` and ``neuron models rm``: the models of the Hugging Face cache, fetched ahead
of time (an image build, a host that will be offline), listed with what neuron makes of each, and removed. No MLX.

The cache is the one every Hugging Face tool shares (``HF_HOME``, ``HF_HUB_CACHE``): what mlx-lm or ``hf download``
fetched is listed too, and ``rm`` frees it for them as well.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron.models import architectures, hub

if TYPE_CHECKING:
    from huggingface_hub import CachedRepoInfo, CachedRevisionInfo

COMMANDS = ("pull", "models")


def add_commands(commands: Any) -> None:
    """Add ``pull`` and ``models`` (with ``models rm``) to the CLI's subcommands."""
    pull = commands.add_parser("pull", help="fetch a model from the Hugging Face Hub into its cache")
    pull.add_argument("model", metavar="ORG/NAME[@REVISION][:QUANT]")
    pull.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    listing = commands.add_parser("models", help="list the models in the Hugging Face cache (rm: remove one)")
    listing.add_argument("--json", action="store_true", help="one JSON object per model revision")
    actions = listing.add_subparsers(dest="models_command", metavar="ACTION")
    rm = actions.add_parser("rm", help="remove models from the cache")
    rm.add_argument("models", nargs="+", metavar="ORG/NAME[@REVISION]")


def run(args: argparse.Namespace) -> int:
    from neuron import log

    log.configure(getattr(args, "log_level", "warning"), "auto")
    try:
        if args.command == "pull":
            return _pull(args.model)
        if args.models_command == "rm":
            return _remove(args.models)
        _list(args.json)
    except (hub.HubError, ValueError, OSError) as e:
        print(f"neuron: error: {e}", file=sys.stderr)
        return 1
    return 0


def _pull(model: str) -> int:
    from neuron.models.folder import fetch

    if hub.parse(model) is None:
        raise hub.HubError(f"{model!r} is not a Hub name: give ORG/NAME, ORG/NAME@REVISION or ORG/NAME:QUANT")
    print(fetch(model))
    return 0


# The listing.


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    revision: str  # the commit
    refs: list[str]  # branches and tags pointing at it
    bytes: int  # on disk
    architecture: str
    serves: str  # how neuron serves it, or why not


def entries() -> list[Entry]:
    from huggingface_hub import scan_cache_dir

    cache = scan_cache_dir(hub.cache_root()) if hub.cache_root().is_dir() else None
    found = []
    for repo in sorted(cache.repos if cache else [], key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            found.append(_entry(repo, revision))
    return found


def _entry(repo: CachedRepoInfo, revision: CachedRevisionInfo) -> Entry:
    folder = Path(revision.snapshot_path)
    ggufs = sorted(p.name for p in folder.rglob("*.gguf"))
    config_file = folder / "config.json"
    arch, serves = "?", "no: it has no config.json"
    if ggufs and not any(folder.glob("model*.safetensors")):
        arch, serves = "gguf", f"converted on start: {', '.join(ggufs)} (as {repo.repo_id}:QUANT)"
    elif config_file.is_file():
        config = json.loads(config_file.read_text())
        arch = architectures.architecture(config)
        serves = how_served(config, repo.repo_id, any(folder.glob("model*.safetensors")))
    return Entry(repo.repo_id, revision.commit_hash, sorted(revision.refs), revision.size_on_disk, arch, serves)


def how_served(config: dict[str, Any], repo: str, has_weights: bool) -> str:
    """Whether neuron serves a model with this config, and how: the tensor-parallel degrees its heads allow, and
    pipeline stages; else why not."""
    if not has_weights:
        return "no: no model*.safetensors in the cache (fetch it with neuron pull)"
    try:
        hub.check_config(config, repo)
    except hub.HubError as e:
        return f"no: {e}"
    text = config.get("text_config", config)
    support = architectures.supports(config)
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    tp = [d for d in range(1, heads + 1) if heads % d == 0 and kv_heads % d == 0]
    if support is not None and support.tp is None:
        tp = [1]
    layers = int(text.get("num_hidden_layers") or 1)
    pp = f"--pp 2..{layers}" if support is not None and support.pp and layers > 1 else "no --pp"
    checked = "" if support is not None else " (not in neuron's table: mlx-lm's code, one rank checked at load)"
    return f"yes: --tp {','.join(map(str, tp))}; {pp}{checked}"


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _list(as_json: bool) -> None:
    found = entries()
    if as_json:
        for entry in found:
            print(json.dumps(asdict(entry)))
        return
    if not found:
        print(f"no models in the Hugging Face cache ({hub.cache_root()}): neuron pull ORG/NAME fetches one")
        return
    rows = [("NAME", "REVISION", "SIZE", "ARCHITECTURE", "SERVED")] + [
        (
            e.name,
            e.revision[:12] + (f" ({', '.join(e.refs)})" if e.refs else ""),
            _size(e.bytes),
            e.architecture,
            e.serves,
        )
        for e in found
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[4])


def _remove(names: list[str]) -> int:
    from huggingface_hub import scan_cache_dir

    cache = scan_cache_dir(hub.cache_root())
    commits = []
    for model in names:
        name = hub.parse(model)
        if name is None:
            raise hub.HubError(f"{model!r} is not a Hub name: give ORG/NAME or ORG/NAME@REVISION")
        revisions = [
            revision
            for repo in cache.repos
            if repo.repo_id == name.repo and repo.repo_type == "model"
            for revision in repo.revisions
            if name.revision is None or name.revision in revision.refs or revision.commit_hash.startswith(name.revision)
        ]
        if not revisions:
            raise hub.HubError(f"{model} is not in the Hugging Face cache ({hub.cache_root()}): neuron models lists it")
        commits += [revision.commit_hash for revision in revisions]
    strategy = cache.delete_revisions(*commits)
    strategy.execute()
    print(f"removed {', '.join(names)}: {_size(strategy.expected_freed_size)} freed")
    return 0
