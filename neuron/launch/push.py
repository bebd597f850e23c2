"""Pushing a rank's share of the model to a host that lacks it (``--push-model``): a second SSH session per share.

The leader runs ``ssh HOST exec <neuron> --receive-share KEY`` beside the
worker's session and speaks to it on its stdin and stdout:

1. leader: the contents, one JSON line (``shares.Contents``: the share's tensors in file
   order, its files' digests);
2. receiver: what it already holds of those contents (tensors and files whose bytes
   match their recorded digests, tensors partly arrived) and its free bytes;
3. leader: for each tensor still missing, a JSON line (name, offset, sha256)
   then its bytes from that offset; for each file, a line and its bytes; then
   ``{"end": true}``; nothing at all when the host holds everything;
4. receiver: every digest checked, the manifest written: ``{"ok", "path"}``,
   or ``{"error"}``.

A cut session (the ssh process killed, the link down) leaves the receiver's
progress on disk, so the next attempt sends only what is missing, resuming a
tensor at the last chunk recorded. No MLX here: the leader's tensors come from
a ``Source`` (``rank.model.share.ShareSource``), evaluated one at a time.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, Protocol

import structlog

from neuron import metrics
from neuron.launch.checks import Refused
from neuron.launch.ssh import StderrRelay
from neuron.models import shares
from neuron.models.folder import DECIDING_FILES

log = structlog.get_logger("neuron.launch")

CHUNK = 1 << 20  # bytes written, and recorded as arrived, at a time
PROGRESS_EVERY_S = 2.0


class PushCut(RuntimeError):
    """The push's session ended before the share was whole; what arrived stays, and the next try resumes."""


# The receiving side, on the host.


def run_receiver(key: str) -> int:
    """``neuron --receive-share KEY``: receive a share into this host's cache; the exit status."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def reply(**fields: object) -> None:
        stdout.write(json.dumps(fields).encode() + b"\n")
        stdout.flush()

    try:
        where = shares.folder(key)
        where.parent.mkdir(parents=True, exist_ok=True)
        # One receiver per share at a time: a session cut on the leader's side may outlive it here for a moment.
        lock = (where.parent / f"{where.name}.lock").open("w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        line = stdin.readline()
        if not line:
            return 0  # the leader left before sending the contents
        contents = shares.Contents.from_json(json.loads(line))
        if contents.key != key or any(name not in DECIDING_FILES for name in contents.files):
            raise shares.ShareError(
                f"the contents announced for {contents.key} do not fit the share {key} this receiver was started for"
            )
        have, resume = shares.held(where, contents)
        if have or resume:
            (where / shares.MANIFEST).unlink(missing_ok=True)  # incomplete again until sealed
        else:
            shares.start_over(where, contents)
        reply(have=sorted(have), resume=resume, free=shutil.disk_usage(where).free, path=str(where))
        if not receive(stdin, where, contents):
            return 0  # the leader stopped before sending (no room): what was held stays
        digest = shares.seal(where, contents)
        reply(ok=True, path=str(where), digest=digest)
        return 0
    except Exception as e:  # noqa: BLE001 - every failure goes back to the leader, in words
        try:
            reply(error=f"{type(e).__name__}: {e}")
        except OSError:
            pass  # the session is gone: no one to tell
        return 1


def receive(stdin: BinaryIO, where: Path, contents: shares.Contents) -> bool:
    """Write what the leader sends into ``where``, recording each chunk; False if it sent nothing and left."""
    _, offsets = shares.layout(contents.entries)
    with (where / shares.WEIGHTS).open("r+b") as weights, (where / shares.PROGRESS).open("a") as progress:

        def record(**fields: object) -> None:
            progress.write(json.dumps(fields) + "\n")
            progress.flush()

        while True:
            line = stdin.readline()
            if not line:
                return False
            header = json.loads(line)
            if header.get("end"):
                return True
            if "file" in header:
                name = header["file"]
                if name not in contents.files:
                    raise shares.ShareError(f"{name} is not a file of the share {contents.key}")
                data = _read_exactly(stdin, int(header["size"]))
                (where / f"{name}.part").write_bytes(data)
                (where / f"{name}.part").replace(where / name)
                continue
            name, offset = header["tensor"], int(header["offset"])
            begin, end = offsets[name]
            digest = shares.sha256_from(where / shares.WEIGHTS, begin, begin + offset)  # what arrived before a cut
            weights.seek(begin + offset)
            written = offset
            while written < end - begin:
                chunk = stdin.read(min(CHUNK, end - begin - written))
                if not chunk:
                    raise PushCut(f"the stream ended inside tensor {name}")
                write_chunk(weights, chunk)
                digest.update(chunk)
                written += len(chunk)
                record(name=name, bytes=written)
            if digest.hexdigest() != header["sha256"]:
                record(name=name, bytes=0)
                raise shares.ShareError(f"tensor {name} arrived with another sha256 than the leader's")
            record(name=name, sha256=header["sha256"])


def write_chunk(weights: BinaryIO, chunk: bytes) -> None:
    """Written and flushed before it is recorded as arrived."""
    weights.write(chunk)
    weights.flush()


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise PushCut(f"the stream ended after {len(data)} of {size} bytes")
    return data


# The sending side, on the leader.


class Source(Protocol):
    """The share's tensors on the leader, each computed when asked (slicing reads the whole tensor)."""

    def data(self, name: str) -> memoryview: ...


@dataclass(frozen=True, slots=True)
class Pushed:
    path: str  # the share's folder on the host
    sent: int  # bytes of tensors and files sent this time
    held: int  # bytes the host already held (whole or in part)
    seconds: float


def needed_bytes(contents: shares.Contents, files: dict[str, Path], have: set[str], resume: dict[str, int]) -> int:
    """Bytes still to send: every tensor and file the host does not hold, less what arrived of a tensor already."""
    tensors = sum(e.size - resume.get(e.name, 0) for e in contents.entries if e.name not in have)
    return tensors + sum(files[name].stat().st_size for name in contents.files if name not in have)


def room_problem(host: str, where: str, needed: int, free: int) -> str | None:
    """Why the host cannot take the share, or None: checked before a byte is sent."""
    if needed <= free:
        return None
    return (
        f"{host} has {free} bytes free at {where}, and its share of the model needs {needed} more: free that much "
        "there, or point NEURON_CACHE_DIR at a larger disk (in the hostfile entry's 'neuron' command)"
    )


def push(
    argv: list[str], contents: shares.Contents, source: Source, files: dict[str, Path], host: str, rank: int
) -> Pushed:
    """Send ``contents``'s share over a session started with ``argv``; blocking (run on a thread of its own).

    Raises ``PushCut`` when the session ends early (the next try resumes) and ``Refused`` when the host refuses
    the share or has no room for it.
    """
    started = time.perf_counter()
    read_end, write_end = os.pipe()
    try:
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=write_end)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    relay = StderrRelay(read_end, rank, host)
    assert process.stdin is not None and process.stdout is not None
    sender = _Sender(process.stdin, process.stdout, host, rank, relay)
    try:
        sender.send_line(contents.to_json())
        held = sender.read_line()
        have, resume, path = set(held["have"]), {k: int(v) for k, v in held["resume"].items()}, held["path"]
        needed = needed_bytes(contents, files, have, resume)
        total = needed_bytes(contents, files, set(), {})
        if problem := room_problem(host, path, needed, int(held["free"])):
            raise Refused(f"rank {rank} on {problem}")
        sender.needed = needed
        sender.bar.reset(needed)
        log.info(
            "push started", rank=rank, host=host, share=contents.key, bytes=needed, held_bytes=total - needed, path=path
        )
        for entry in contents.entries:
            if entry.name not in have:
                sender.tensor(entry.name, source.data(entry.name), resume.get(entry.name, 0))
        for name in contents.files:
            if name not in have:
                data = files[name].read_bytes()
                sender.send_line({"file": name, "size": len(data)})
                sender.send(memoryview(data))
        sender.send_line({"end": True})
        done = sender.read_line()
        pushed = Pushed(done["path"], sender.sent, total - needed, time.perf_counter() - started)
        log.info(
            "push done", rank=rank, host=host, share=contents.key, bytes=pushed.sent, seconds=round(pushed.seconds, 2)
        )
        return pushed
    finally:
        sender.bar.close()
        _close(process)


class _Sender:
    def __init__(self, stdin: IO[bytes], stdout: IO[bytes], host: str, rank: int, relay: StderrRelay) -> None:
        self.stdin = stdin
        self.stdout = stdout
        self.host = host
        self.rank = rank
        self.relay = relay
        self.sent = 0
        self.needed = 0  # bytes of tensors and files to send, once the host said what it holds
        self._logged = time.monotonic()
        from huggingface_hub.utils import tqdm  # tqdm itself, typed; huggingface_hub brings it

        # On a terminal, tqdm's bar (bytes, rate, time left) as for a download; the log lines either way.
        self.bar = tqdm(desc=f"push to {host}", unit="B", unit_scale=True, disable=not sys.stderr.isatty())

    def send(self, data: memoryview) -> None:
        for start in range(0, len(data), CHUNK):
            chunk = data[start : start + CHUNK]
            try:
                self.stdin.write(chunk)
            except (BrokenPipeError, ValueError, OSError) as e:
                raise self.cut(f"writing to it failed ({e})") from None
            self.sent += len(chunk)
            self.bar.update(len(chunk))
            metrics.PUSH_BYTES.labels(self.host).inc(len(chunk))
            if time.monotonic() - self._logged >= PROGRESS_EVERY_S:
                self._logged = time.monotonic()
                log.info("push progress", rank=self.rank, host=self.host, sent=self.sent, of=self.needed)

    def send_line(self, fields: dict[str, object]) -> None:
        self.send(memoryview(json.dumps(fields).encode() + b"\n"))
        try:
            self.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as e:
            raise self.cut(f"writing to it failed ({e})") from None

    def tensor(self, name: str, data: memoryview, offset: int) -> None:
        bytes_view = data.cast("B")
        self.send_line({"tensor": name, "offset": offset, "sha256": hashlib.sha256(bytes_view).hexdigest()})
        self.send(bytes_view[offset:])

    def read_line(self) -> dict:
        try:
            self.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as e:
            raise self.cut(f"writing to it failed ({e})") from None
        line = self.stdout.readline()
        if not line:
            raise self.cut("it ended")
        answer = json.loads(line)
        if "error" in answer:
            raise Refused(f"{self.host} could not take its share of the model: {answer['error']}")
        return dict(answer)

    def cut(self, what: str) -> PushCut:
        words = self.relay.last_words()
        return PushCut(f"the push session to {self.host} was cut: {what}" + (f" ({words})" if words else ""))


def _close(process: subprocess.Popen[bytes]) -> None:
    for stream in (process.stdin, process.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
