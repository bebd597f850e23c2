"""Models by name from the Hugging Face Hub: ``ORG/NAME``, ``ORG/NAME@REVISION`` and ``ORG/NAME[@REVISION]:QUANT``
(a GGUF file of the repository, as llama.cpp's ``-hf`` picks one), fetched into the standard Hugging Face cache.
No MLX here.

Why the standard cache (``HF_HOME``, ``HF_HUB_CACHE``): a model mlx-lm, LM Studio or ``hf download`` already
fetched is used where it lies, and nothing is stored twice. ``huggingface_hub`` does the fetching: it reads
``HF_TOKEN``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` itself. Every file is written beside its final name and
renamed whole once complete, so a half file is never taken for a whole one; a cut download of the weights resumes
where it stopped (``_resumable``).

Why the repository is judged before its weights are fetched: listing its files and reading its ``config.json``
costs two small requests, while a model neuron cannot serve (an architecture it lacks, weights in a format it does
not read, a GGUF repository with no file named) could cost gigabytes before the load fails.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron.models import architectures

if TYPE_CHECKING:
    from huggingface_hub import HfApi

    from neuron.models.progress import Download

# The files neuron reads of a model: config, tokenizer and template files, the safetensors its ranks load (and
# their index), and a sentence-transformers card's pooling. Never *.bin, *.pth, consolidated.* or other formats.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "modules.json",
    "1_Pooling/config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
]
_WEIGHTS = re.compile(r"^model[^/]*\.safetensors$")
_OTHER_FORMATS = (".bin", ".pth", ".pt", ".ckpt", ".h5", ".msgpack", ".onnx", ".safetensors")
# Quantizations made for PyTorch kernels, which mlx-lm cannot load (its own are in ``quantization``).
_TORCH_QUANTS = {"gptq", "awq", "bitsandbytes", "aqlm", "hqq", "eetq", "exl2", "compressed-tensors", "fbgemm_fp8"}

_NAME = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s:@]+))?(?::(?P<quant>[\w.-]+))?$"
)


class HubError(ValueError):
    """A model name that cannot be fetched or served as asked; the message says what to do."""


@dataclass(frozen=True, slots=True)
class HubName:
    repo: str
    revision: str | None = None  # a branch, tag or commit; None: main
    quant: str | None = None  # a GGUF file's quantization (Q4_K_M, Q8_0, ...)

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.quant}" if self.quant else "")


def parse(model: str | None) -> HubName | None:
    """``model`` as a Hub name, or None when it is a path: anything that exists on disk, or starts as a path does."""
    if not model or model.startswith(("/", ".", "~")) or model.lower().endswith(".gguf") or Path(model).exists():
        return None
    match = _NAME.match(model)
    if match is None:
        return None
    return HubName(match["repo"], match["revision"], match["quant"])


def cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


# What neuron makes of a repository, before fetching it.


@dataclass(frozen=True, slots=True)
class Fetch:
    """What to fetch of a repository: its safetensors model (``gguf`` None), or one GGUF file."""

    commit: str
    gguf: str | None
    weight_bytes: int


def to_fetch(name: HubName, files: dict[str, int | None], commit: str) -> Fetch:
    """Refuse a repository neuron cannot read, by its file list alone; else what to fetch of it."""
    ggufs = sorted(f for f in files if f.endswith(".gguf") and "mmproj" not in f.lower())
    if name.quant is not None:
        gguf = pick_gguf(name, ggufs)
        return Fetch(commit, gguf, files.get(gguf) or 0)
    weights = [f for f in files if _WEIGHTS.match(f)]
    if weights:
        return Fetch(commit, None, sum(files[f] or 0 for f in weights))
    if ggufs:
        quants = sorted({q for f in ggufs if (q := _quant_of(f))}) or ggufs
        raise HubError(f"{name.repo} holds GGUF files only: name one as {name.repo}:QUANT (it has {', '.join(quants)})")
    others = sorted(f for f in files if f.endswith(_OTHER_FORMATS))
    held = f" (it holds {', '.join(others[:3])}{', ...' if len(others) > 3 else ''})" if others else ""
    raise HubError(
        f"{name.repo} has no model*.safetensors weights, the format neuron reads{held}: pick a repository with "
        "safetensors (an mlx-community conversion, for one) or a GGUF file as ORG/NAME:QUANT"
    )


def _quant_of(filename: str) -> str | None:
    match = re.search(r"[-._]((?:I?Q\d\w*)|F16|F32|BF16)(?:-\d+-of-\d+)?\.gguf$", filename, re.IGNORECASE)
    return match.group(1).upper() if match else None


def pick_gguf(name: HubName, ggufs: list[str]) -> str:
    """The GGUF file ``:QUANT`` names, as llama.cpp's ``-hf`` matches it: the quantization in the file's name."""
    assert name.quant is not None
    pattern = re.compile(rf"(^|[-._/]){re.escape(name.quant)}([-._]|$)", re.IGNORECASE)
    matches = [f for f in ggufs if pattern.search(f.rsplit("/", 1)[-1].removesuffix(".gguf"))]
    if not matches:
        quants = sorted({q for f in ggufs if (q := _quant_of(f))})
        has = f"it has {', '.join(quants)}" if quants else "it holds no GGUF file"
        raise HubError(f"{name.repo} has no GGUF file for {name.quant!r} ({has}): name one of those")
    if any(re.search(r"-\d+-of-\d+\.gguf$", f) for f in matches):
        raise HubError(
            f"{name.repo}'s {name.quant} GGUF is split in parts ({matches[0]}, ...), which neuron does not join: "
            "pick a smaller quantization held in one file"
        )
    if len(matches) > 1:
        raise HubError(f"{name.repo} has several GGUF files for {name.quant!r} ({', '.join(matches)}): name one")
    return matches[0]


def check_config(config: dict[str, Any], repo: str) -> None:
    """Refuse, from ``config.json`` alone, a model neuron cannot serve: an architecture neither neuron's table
    nor mlx-lm has, code shipped with the model, weights quantized for PyTorch."""
    if "model_file" in config or ("auto_map" in config and not _known(architectures.architecture(config))):
        raise HubError(
            f"{repo} needs its own Python code to build the model; neuron never runs code shipped with a model: "
            "pick a model of an architecture mlx-lm supports"
        )
    arch = architectures.architecture(config)
    if not _known(arch):
        served = ", ".join(sorted(architectures.TABLE))
        raise HubError(
            f"{repo} is a {arch!r} model, an architecture neither neuron nor mlx-lm serves (neuron's table: "
            f"{served}; mlx-lm's models besides): pick a model of one of those"
        )
    method = str((config.get("quantization_config") or {}).get("quant_method", "")).lower()
    if method in _TORCH_QUANTS:
        raise HubError(
            f"{repo} is quantized with {method}, a PyTorch format neuron does not read: pick its MLX conversion "
            "(mlx-community publishes most) or the unquantized model"
        )


def _known(arch: str) -> bool:
    """In neuron's table, or a model mlx-lm has code for (found by its file: importing mlx-lm would load MLX)."""
    if arch in architectures.TABLE:
        return True
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = Path(next(iter(spec.submodule_search_locations))) / "models"
    return re.fullmatch(r"\w+", arch) is not None and (folder / f"{arch}.py").is_file()


# Fetching.


def fetch(name: HubName, download: Download | None = None, weights: list[str] | None = None) -> Path:
    """The local path of ``name``: its snapshot folder, or its GGUF file; fetched (or completed) when the Hub is
    reachable, taken from the cache alone under ``HF_HUB_OFFLINE=1``. ``weights``: only these of its safetensors
    files (a pipeline stage's, ``shares.files_read``); None: every one."""
    import httpx2

    from neuron.models.progress import Download  # here: the worker and the CLI import this module, rarely fetch

    download = download or Download(str(name))
    try:
        if offline():
            return _cached(name, weights)
        return _fetch(name, download, weights)
    except HubError:
        raise
    except (OSError, ValueError, httpx2.HTTPError) as e:  # huggingface_hub's own errors, said in one line
        raise _explain(e, name) from None


def fetch_adapter(name: HubName) -> Path:
    """A LoRA adapter's repository (its ``adapter_config.json`` and safetensors, ``neuron.models.adapters``): fetched
    into the cache, or taken from it under ``HF_HUB_OFFLINE=1`` or when the Hub cannot be reached."""
    import httpx2
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["adapter_config.json", "adapters.safetensors", "adapter_model.safetensors"]
    try:
        return Path(snapshot_download(name.repo, revision=name.revision, allow_patterns=patterns,
                                      local_files_only=offline()))  # fmt: skip
    except LocalEntryNotFoundError:
        raise _not_cached(name) from None
    except (OSError, ValueError, httpx2.HTTPError) as e:
        raise _explain(e, name) from None


def _api() -> HfApi:
    from huggingface_hub import HfApi

    return HfApi()


def _fetch(name: HubName, download: Download, weights: list[str] | None) -> Path:
    import httpx2
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = _api().model_info(name.repo, revision=name.revision, files_metadata=True)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise
    except (httpx2.ConnectError, httpx2.TimeoutException, HfHubHTTPError) as e:
        try:  # the Hub is out of reach or failing: what the cache holds will do
            return _cached(name, weights)
        except HubError:
            raise _explain(e, name) from None
    assert info.sha is not None
    files = {s.rfilename: s.size for s in info.siblings or []}
    what = to_fetch(name, files, info.sha)
    revision = name.revision or "main"
    bars = download.bars()
    if what.gguf is not None:
        download.start(1, files.get(what.gguf) or 0)
        _resumable(name.repo, what.gguf, info.sha, bars)
        path = hf_hub_download(name.repo, what.gguf, revision=revision)  # in place: records the revision's ref
        download.finish()
        return Path(path)
    config = Path(hf_hub_download(name.repo, "config.json", revision=info.sha))
    check_config(json.loads(config.read_text()), name.repo)
    if lacking := sorted(set(weights or ()) - set(files)):
        raise HubError(f"{name} has no {lacking[0]}, which the leader's copy of it has: pin both to one commit")
    wanted = _wanted(files, weights)
    download.start(len(wanted), sum(files.get(f) or 0 for f in wanted if f != "config.json"))  # that one is here
    for file in sorted(f for f in wanted if _WEIGHTS.match(f)):
        _resumable(name.repo, file, info.sha, bars)
    # The rest (small files), and the revision's ref and tree, as huggingface_hub records them.
    folder = snapshot_download(name.repo, revision=revision, allow_patterns=_patterns(weights), tqdm_class=bars)
    download.finish()
    return Path(folder)


def _resumable(repo: str, filename: str, commit: str, bars: type[Any]) -> None:
    """Fetch one large file into the cache as ``hf_hub_download`` lays it out (``blobs/ETAG``, linked from
    ``snapshots/COMMIT/FILE``), resuming what an earlier, cut attempt left in ``blobs/ETAG.incomplete``.

    Why not ``hf_hub_download`` itself: since huggingface_hub 1.x it downloads to a file unique to each process
    and deletes it on failure, so a killed start, a full disk or a dropped link begins the file again from its
    first byte: gigabytes, for a model's weights. ``http_get`` resumes with a range request.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    storage = cache_root() / repo_folder_name(repo_id=repo, repo_type="model")
    pointer = storage / "snapshots" / commit / filename
    if pointer.exists():
        return
    meta = get_hf_file_metadata(hf_hub_url(repo, filename, revision=commit))
    if meta.etag is None:
        raise HubError(f"the Hub gave no ETag for {repo}/{filename}: check HF_ENDPOINT points at a Hub")
    blob = storage / "blobs" / meta.etag
    part = blob.with_name(f"{meta.etag}.incomplete")
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(cache_root() / ".locks" / storage.name / f"{meta.etag}.lock"):
        if not blob.exists():
            with part.open("ab") as f:
                http_get(
                    meta.location,
                    f,
                    resume_size=f.tell(),
                    headers=build_hf_headers(),
                    expected_size=meta.size,
                    displayed_filename=filename,
                    tqdm_class=bars,
                )
            os.replace(part, blob)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        if not pointer.exists():
            os.symlink(os.path.relpath(blob, pointer.parent), pointer)


def _patterns(weights: list[str] | None) -> list[str]:
    """``ALLOW_PATTERNS``, with only ``weights`` of the safetensors files where given."""
    return ALLOW_PATTERNS if weights is None else [p for p in ALLOW_PATTERNS if p != "model*.safetensors"] + weights


def _wanted(files: dict[str, int | None], weights: list[str] | None = None) -> list[str]:
    from huggingface_hub.utils import filter_repo_objects

    return list(filter_repo_objects(list(files), allow_patterns=_patterns(weights)))


def _cached(name: HubName, weights: list[str] | None = None) -> Path:
    """``name`` from the cache alone; refused at once when it is not there whole."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if name.quant is not None:
        snapshot = cached_snapshot(name)
        if snapshot is None:
            raise _not_cached(name)
        return snapshot / pick_gguf(name, sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.gguf")))
    try:
        folder = Path(
            snapshot_download(
                name.repo, revision=name.revision, allow_patterns=_patterns(weights), local_files_only=True
            )
        )
    except LocalEntryNotFoundError:
        raise _not_cached(name) from None
    whole = all((folder / w).is_file() for w in weights) if weights else any(folder.glob("model*.safetensors"))
    if not whole:
        raise _not_cached(name)
    check_config(json.loads((folder / "config.json").read_text()), name.repo)
    return folder


def cached_snapshot(name: HubName) -> Path | None:
    """The snapshot folder the cache holds for ``name``'s revision (a branch or tag through its ref), if any."""
    from huggingface_hub.file_download import repo_folder_name

    storage = cache_root() / repo_folder_name(repo_id=name.repo, repo_type="model")
    revision = name.revision or "main"
    ref = storage / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = storage / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _not_cached(name: HubName) -> HubError:
    why = "HF_HUB_OFFLINE=1 forbids fetching it" if offline() else f"the Hub ({endpoint()}) cannot be reached"
    return HubError(
        f"{name} is not in the Hugging Face cache ({cache_root()}) whole, and {why}: run `neuron pull {name}` "
        "where the Hub is reachable (then copy the cache here), or unset HF_HUB_OFFLINE"
    )


def _explain(error: BaseException, name: HubName) -> HubError:
    """One line for what went wrong, saying what to do."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    status = getattr(getattr(error, "response", None), "status_code", None)
    token = bool(os.environ.get("HF_TOKEN"))
    if isinstance(error, GatedRepoError):
        if status == 403 or token:
            return HubError(
                f"{name.repo} is gated and the token in HF_TOKEN has no access to it: accept its conditions on its "
                "Hub page with that account, or set HF_TOKEN to a token of an account that did"
            )
        return HubError(
            f"{name.repo} is gated: accept its conditions on its Hub page, then set HF_TOKEN to a token of that "
            "account (hf auth login writes one)"
        )
    if isinstance(error, RevisionNotFoundError):
        return HubError(
            f"{name.repo} has no revision {name.revision!r} (a branch, tag or commit): check it, or leave "
            "@REVISION off to take main"
        )
    if isinstance(error, RepositoryNotFoundError):
        return HubError(
            f"{name.repo} is not on the Hub ({endpoint()}), or is private and HF_TOKEN cannot read it: check the "
            "name, or set HF_TOKEN to a token that can"
        )
    if isinstance(error, RemoteEntryNotFoundError):
        return HubError(f"{name} lacks a file neuron needs ({error}): pick another revision or repository")
    if isinstance(error, HfHubHTTPError) and status == 401:
        return HubError(
            "the Hub refused the token in HF_TOKEN (invalid credentials): set a valid token (hf auth login), or "
            f"unset it to fetch public {name.repo}"
        )
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return HubError(
            f"no space left on the disk holding the Hugging Face cache ({cache_root()}) while fetching {name}: free "
            "space (neuron models rm) or set HF_HOME to a larger disk; the next start resumes the download"
        )
    if isinstance(error, LocalEntryNotFoundError) or _network_error(error):
        return _not_cached(name)
    if isinstance(error, HfHubHTTPError):
        return HubError(f"the Hub ({endpoint()}) failed fetching {name} ({status}): try again later")
    return HubError(f"fetching {name} failed: {type(error).__name__}: {error}")


def _network_error(error: BaseException) -> bool:
    import httpx2

    return isinstance(error, (httpx2.TransportError, ConnectionError, TimeoutError))


# Across hosts: each host fetches its ranks' files from the Hub itself, or receives its share from the leader
# (``--push-model``, neuron/launch/push.py). Which one is the operator's choice; the default works on a cluster
# where only the leader reaches the Hub.


def pinned(model: str | None, path: str | Path) -> str | None:
    """``model`` pinned to the commit the leader resolved (its snapshot folder's name), so that every host
    fetches that very revision even when its branch moves meanwhile; any other ``model`` as it is."""
    name = parse(model)
    folder = Path(path)
    if name is None or folder.parent.name != "snapshots" or not re.fullmatch(r"[0-9a-f]{40}", folder.name):
        return model
    return str(HubName(name.repo, folder.name, name.quant))


def leader_may_push(model: str | None, push: bool) -> bool:
    """Whether the leader sends a host that cannot get the model its share: always for a model named on the
    Hub (a host that cannot reach the Hub still serves), else only with ``--push-model``."""
    return push or parse(model) is not None


def host_env(model: str | None, push: bool) -> dict[str, str]:
    """The environment a worker on another host gets: with ``--push-model``, a model named on the Hub comes
    from the host's cache or the leader, never from the Hub (``HF_HUB_OFFLINE=1``: it does not try)."""
    return {"HF_HUB_OFFLINE": "1"} if push and parse(model) is not None else {}


def token(model: str | None, push: bool) -> str:
    """The Hugging Face token a worker on another host is given to fetch ``model`` from the Hub itself: the
    leader's (``HF_TOKEN``, or the file ``hf auth login`` writes), so that a gated repository set up once on the
    leader is fetched everywhere; empty for a model the host does not fetch (a path, or under ``--push-model``)."""
    if push or parse(model) is None:
        return ""
    from huggingface_hub import get_token

    return get_token() or ""
