"""A download's progress, followed three ways: ``huggingface_hub``'s own progress bars on a terminal, a structured
log line at intervals otherwise (under systemd, piped), and a snapshot the leader's ``/ready`` answers with while
the model is fetched; every byte also counts in ``neuron_hub_bytes`` (``/metrics``). No MLX here.

Why the Hub's bars: they are tqdm's (bytes, rate, time left), drawn only when their stream is a terminal, and
``huggingface_hub`` feeds them from every file and thread of a snapshot; neuron only listens to them.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import Any

import structlog

log = structlog.get_logger("neuron.hub")

LOG_EVERY_S = 2.0


def _bars_drawn() -> bool:
    """Whether the Hub's bars show: on a terminal, unless ``HF_HUB_DISABLE_PROGRESS_BARS`` turned them off."""
    from huggingface_hub.utils import are_progress_bars_disabled

    return sys.stderr.isatty() and not are_progress_bars_disabled()


class Download:
    """What one fetch has done so far; safe to read from another thread (the HTTP server's)."""

    def __init__(self, model: str, log_every: float = LOG_EVERY_S) -> None:
        self.model = model
        self.files = 0
        self.files_done = 0
        self.total = 0  # bytes to fetch, as the Hub's file list says; grows to what the bars say
        self.done = 0
        self.started = time.monotonic()
        self.finished = False
        self._log_every = log_every
        self._logged = 0.0
        self._lock = threading.Lock()

    def start(self, files: int, total: int) -> None:
        with self._lock:
            self.files, self.total, self.started = files, total, time.monotonic()
        log.info("fetching", model=self.model, files=files, bytes_total=total)

    def advance(self, n: int, total: int | None = None, fetched: bool = True) -> None:
        """``n`` more bytes arrived (negative: a restarted file's bytes taken back); ``fetched`` False: they were
        on disk already, from a download that was cut."""
        with self._lock:
            self.done += n
            if total and total > self.total:
                self.total = total
            due = time.monotonic() - self._logged >= self._log_every
            if due:
                self._logged = time.monotonic()
        if n > 0 and fetched:
            from neuron import metrics  # here: every worker imports this module (models, gguf), few fetch

            metrics.HUB_BYTES.inc(n)
        if due and not _bars_drawn():
            log.info("fetching", **self.snapshot())

    def file_done(self) -> None:
        with self._lock:
            self.files_done += 1

    def finish(self) -> None:
        with self._lock:
            self.finished = True
            self.files_done = max(self.files_done, self.files)
        log.info("fetched", **self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        """For ``/ready`` and the log lines: model, files and bytes done of total, rate and seconds left."""
        with self._lock:
            seconds = max(time.monotonic() - self.started, 1e-6)
            rate = self.done / seconds
            left = max(self.total - self.done, 0)
            return {
                "model": self.model,
                "files_done": self.files_done,
                "files": self.files,
                "bytes_done": self.done,
                "bytes_total": self.total,
                "bytes_per_second": round(rate),
                "seconds_left": round(left / rate, 1) if rate > 0 and not self.finished else None,
            }

    def bars(self) -> type[Any]:
        """A tqdm class for ``huggingface_hub``'s ``tqdm_class``: its bars as the Hub draws them, feeding this."""
        from huggingface_hub.utils import tqdm as hub_tqdm

        download = self

        class Bar(hub_tqdm):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                # The bytes bar (``unit="B"``) counts; the transfer bar beside it repeats the same bytes, and the
                # files bar counts files.
                name = str(kwargs.get("name") or "")
                self._kind = "files" if kwargs.get("unit", "it") != "B" else "skip" if "transfer" in name else "bytes"
                initial = int(kwargs.get("initial") or 0)
                kwargs.setdefault("disable", None)  # tqdm's None: drawn on a terminal only (the log lines elsewhere)
                super().__init__(*args, **kwargs)
                if self._kind == "bytes" and initial:
                    download.advance(initial, kwargs.get("total"), fetched=False)

            def update(self, n: float | None = 1) -> bool | None:
                if self._kind == "bytes":
                    download.advance(int(n or 0), self.total)
                elif self._kind == "files":
                    download.file_done()
                return super().update(n)

        return Bar


class Meter:
    """Bytes through a long step that is not a download (a GGUF file's conversion), shown as a download is: the
    same tqdm bar on a terminal (bytes, rate, time left), otherwise the same structured line at intervals (bytes
    done of total), and one line once done."""

    def __init__(self, event: str, total: int, log_every: float = LOG_EVERY_S, **fields: Any) -> None:
        from huggingface_hub.utils import tqdm

        self.event, self.total, self.fields = event, total, fields
        self.done = 0
        self._log_every = log_every
        self._logged = time.monotonic()
        self._bar = tqdm(desc=event, total=total, unit="B", unit_scale=True, disable=not _bars_drawn())
        log.info(event, bytes_done=0, bytes_total=total, **fields)

    def __enter__(self) -> Meter:
        return self

    def advance(self, n: int) -> None:
        self.done += n
        self._bar.update(n)
        if not _bars_drawn() and time.monotonic() - self._logged >= self._log_every:
            self._logged = time.monotonic()
            log.info(self.event, bytes_done=self.done, bytes_total=self.total, **self.fields)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._bar.close()
        if kind is None:
            log.info(f"{self.event} done", bytes_done=self.done, bytes_total=self.total, **self.fields)
