"""A local server speaking the Hugging Face Hub's HTTP protocol, for the tests: the real ``huggingface_hub`` client
fetches from it when ``HF_ENDPOINT`` points here.

It answers the routes the client calls: repository and revision info (``/api/models/ORG/NAME[/revision/REV]``),
the file tree (``/api/models/ORG/NAME/tree/REV``), file metadata (``HEAD /ORG/NAME/resolve/REV/FILE``: ``ETag``,
``X-Repo-Commit``; for large files a redirect to a content URL with ``X-Linked-Etag`` and ``X-Linked-Size``, as the
Hub's LFS files do) and downloads with range requests. Gated repositories answer 401 without a token and 403 with
one not granted, with the Hub's ``X-Error-Code`` headers. It serves no Xet headers, so the client never tries Xet.

Every request is recorded (method, path, range, status) so a test can say which files were fetched, and large
bodies can be throttled so a test can stop a download midway.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_FROM = 1024  # files at least this large are served as LFS files (a redirect to their content URL)


@dataclass
class Repo:
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> file name -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    token: str | None = None  # gated: only this token may download


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    status: int
    authorization: str | None
    client: str  # the address the request came from


class LocalHub:
    """Serve repositories from memory on 127.0.0.1 (or ``host``); ``url`` is what ``HF_ENDPOINT`` takes."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, rate: float | None = None) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.contents: dict[str, bytes] = {}  # content URLs' bytes, by sha256
        self.names: dict[str, str] = {}  # content URLs' file names (ORG/NAME/FILE), by sha256
        self.rate = rate  # bytes per second for LFS bodies; None: as fast as the socket takes them
        self.tokens: set[str] = set()  # the tokens the Hub knows; any other is refused on every route, as the Hub does
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            owner = hub

        # Two ports, as the Hub and its content host: the client follows a redirect on the Hub's own host (and
        # then misses the Hub's headers), but stops at one to another host and reads the file's metadata there.
        self._servers = [ThreadingHTTPServer((host, port), Handler), ThreadingHTTPServer((host, 0), Handler)]
        self._threads = []
        for server in self._servers:
            server.daemon_threads = True
            self._threads.append(threading.Thread(target=server.serve_forever, name="local-hub", daemon=True))

    @property
    def url(self) -> str:
        host, port = self._servers[0].server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def content_url(self) -> str:
        host, port = self._servers[1].server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> LocalHub:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def add(
        self,
        repo_id: str,
        folder: Path | dict[str, bytes],
        *,
        branch: str = "main",
        tags: tuple[str, ...] = (),
        token: str | None = None,
    ) -> str:
        """Publish ``folder``'s files (or the given name -> bytes) as a new commit on ``branch``; its hash."""
        files = (
            {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
            if isinstance(folder, Path)
            else dict(folder)
        )
        commit = secrets.token_hex(20)
        repo = self.repos.setdefault(repo_id, Repo())
        repo.files[commit] = files
        repo.refs[branch] = commit
        for tag in tags:
            repo.refs[tag] = commit
        if token is not None:
            repo.token = token
        return commit

    def fetched(self, repo_id: str) -> list[str]:
        """The files of ``repo_id`` whose bytes were sent (a GET answered with a body), in order, each once."""
        prefix = f"/{repo_id}/resolve/"
        names = []
        for r in self.requests:
            if r.method != "GET" or r.status not in (200, 206):
                continue
            if r.path.startswith(prefix):
                name = r.path[len(prefix) :].split("/", 1)[1]
            elif r.path.startswith("/content/") and self.names.get(r.path[9:], "").startswith(f"{repo_id}/"):
                name = self.names[r.path[9:]][len(repo_id) + 1 :]
            else:
                continue
            if name not in names:
                names.append(name)
        return names

    def ranges(self, repo_id: str, name: str) -> list[str | None]:
        """The Range headers of each GET of ``repo_id``'s file ``name`` (None: the whole file)."""
        digests = {d for d, n in self.names.items() if n == f"{repo_id}/{name}"}
        return [
            r.range
            for r in self.requests
            if r.method == "GET"
            and ((r.path.startswith(f"/{repo_id}/resolve/") and r.path.endswith(f"/{name}")) or r.path[9:] in digests)
        ]

    def record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)


TOKEN = "hf_granted"  # a token the tests' gated repositories grant


def hub_env(server: LocalHub | None, home: Path, **extra: str) -> dict[str, str]:
    """A neuron's environment for the Hub at ``server`` (None: nothing listens there), its cache under ``home``."""
    return {
        "HF_ENDPOINT": server.url if server else "http://127.0.0.1:9",  # the discard port: nothing listens
        "HF_HOME": str(home),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_TOKEN": "",
        **extra,
    }


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_REPO_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/(.*))?)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_CONTENT = re.compile(r"^/content/([0-9a-f]{64})$")


class _Handler(BaseHTTPRequestHandler):
    owner: LocalHub
    protocol_version = "HTTP/1.1"
    # huggingface_hub keeps its connections alive, and a reply is written head first and body after: with Nagle's
    # algorithm on, each small one waited for the client's delayed ACK (as the leader's did, leader.bind).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: object) -> None:
        pass  # recorded in ``LocalHub.requests`` instead

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    # Answers.

    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, *, head: bool = False
    ) -> None:
        self.owner.record(
            Request(
                self.command,
                unquote(urlsplit(self.path).path),
                self.headers.get("Range"),
                status,
                self._auth(),
                self.client_address[0],
            )
        )
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self._write(body)

    def _write(self, body: bytes) -> None:
        start = 0
        while len(body) >= LFS_FROM and start < len(body):
            rate = self.owner.rate  # read at every piece: a test that lifts it lets the rest through at once
            if rate is None:
                break
            piece = max(1, int(rate / 20))
            self.wfile.write(body[start : start + piece])
            self.wfile.flush()
            start += piece
            time.sleep(piece / rate)
        self.wfile.write(body[start:])

    def _error(self, status: int, code: str | None, message: str, *, head: bool) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers, head=head)

    def _auth(self) -> str | None:
        value = self.headers.get("Authorization", "")
        return value.removeprefix("Bearer ").strip() or None

    # Routing.

    def _route(self, *, head: bool) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        try:
            if (token := self._auth()) is not None and token not in self.owner.tokens:
                self._error(401, None, "Invalid credentials in Authorization header", head=head)
            elif match := _REPO_API.match(path):
                self._api(match, parse_qs(url.query), head=head)
            elif match := _RESOLVE.match(path):
                self._resolve(match.group(1), match.group(2), match.group(3), head=head)
            elif match := _CONTENT.match(path):
                self._content(match.group(1), head=head)
            else:
                self._error(404, None, "Not Found", head=head)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left mid-body (a download killed on purpose)

    def _repo(self, repo_id: str, *, head: bool) -> Repo | None:
        repo = self.owner.repos.get(repo_id)
        if repo is None:
            self._error(401, "RepoNotFound", "Repository not found", head=head)
        return repo

    def _commit(self, repo: Repo, revision: str, *, head: bool) -> str | None:
        commit = repo.refs.get(revision) or (revision if revision in repo.files else None)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head=head)
        return commit

    def _api(self, match: re.Match[str], query: dict[str, list[str]], *, head: bool) -> None:
        repo_id, kind, revision, _ = match.groups()
        if (repo := self._repo(repo_id, head=head)) is None:
            return
        if (commit := self._commit(repo, revision or "main", head=head)) is None:
            return
        files = repo.files[commit]
        if kind == "tree":
            tree = [
                {"type": "file", "oid": _sha1(data), "size": len(data), "path": name}
                | (
                    {"lfs": {"oid": _sha256(data), "size": len(data), "pointerSize": 134}}
                    if len(data) >= LFS_FROM
                    else {}
                )
                for name, data in sorted(files.items())
            ]
            self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head=head)
            return
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = [
            {"rfilename": name}
            | (
                {"size": len(data), "blobId": _sha1(data)}
                | (
                    {"lfs": {"size": len(data), "sha256": _sha256(data), "pointerSize": 134}}
                    if len(data) >= LFS_FROM
                    else {}
                )
                if blobs
                else {}
            )
            for name, data in sorted(files.items())
        ]
        info = {
            "_id": repo_id,
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": False,
            "gated": "manual" if repo.token else False,
            "disabled": False,
            "tags": [],
            "siblings": siblings,
        }
        self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head=head)

    def _resolve(self, repo_id: str, revision: str, name: str, *, head: bool) -> None:
        if (repo := self._repo(repo_id, head=head)) is None:
            return
        if (commit := self._commit(repo, revision, head=head)) is None:
            return
        if repo.token is not None:
            token = self._auth()
            if token is None:
                self._error(401, "GatedRepo", "Access to this model is restricted: log in", head=head)
                return
            if token != repo.token:
                self._error(
                    403, "GatedRepo", "Access to this model is restricted and you are not in the list", head=head
                )
                return
        data = repo.files[commit].get(name)
        if data is None:
            self._error(404, "EntryNotFound", f"{name} does not exist on {revision}", head=head)
            return
        common = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if len(data) >= LFS_FROM:
            digest = _sha256(data)
            self.owner.contents[digest] = data
            self.owner.names[digest] = f"{repo_id}/{name}"
            headers = {
                **common,
                "Location": f"{self.owner.content_url}/content/{digest}",
                "X-Linked-Etag": f'"{digest}"',
                "X-Linked-Size": str(len(data)),
                "ETag": f'"{_sha1(data)}"',
            }
            self._send(302, b"", headers, head=head)
            return
        self._body(data, {**common, "ETag": f'"{_sha1(data)}"'}, head=head)

    def _content(self, digest: str, *, head: bool) -> None:
        data = self.owner.contents.get(digest)
        if data is None:
            self._error(404, None, "no such content", head=head)
            return
        self._body(data, {"ETag": f'"{digest}"', "Accept-Ranges": "bytes"}, head=head)

    def _body(self, data: bytes, headers: dict[str, str], *, head: bool) -> None:
        wanted = self.headers.get("Range")
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted or "")
        if match is None:
            self._send(200, data, {**headers, "Content-Type": "application/octet-stream"}, head=head)
            return
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) else len(data) - 1
        if start >= len(data):
            self._send(416, b"", {**headers, "Content-Range": f"bytes */{len(data)}"}, head=head)
            return
        part = data[start : end + 1]
        ranged = {
            **headers,
            "Content-Range": f"bytes {start}-{end}/{len(data)}",
            "Content-Type": "application/octet-stream",
        }
        self._send(206, part, ranged, head=head)
