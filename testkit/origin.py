"""A real HTTP server on this host that image URLs point at: pictures, and the ways a server misbehaves."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    files: dict[str, bytes]
    release: threading.Event

    def do_GET(self) -> None:
        misbehaving = {
            "/redirect": lambda: self._send(302, b"", location="/a.png"),
            "/loop": lambda: self._send(302, b"", location="/loop"),
            "/to-file": lambda: self._send(302, b"", location="file:///etc/passwd"),
            "/big": lambda: self._send(200, b"\0" * 5000),
            "/unsized": self._unsized,
            "/slow": self._slow,
        }
        if self.path in self.files:
            self._send(200, self.files[self.path])
        else:
            misbehaving.get(self.path, lambda: self._send(404, b"no"))()

    def _send(self, status: int, body: bytes, location: str | None = None) -> None:
        self.send_response(status)
        if location is not None:
            self.send_header("location", location)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _unsized(self) -> None:
        """A body of 10,000 bytes with no length given: read until the connection closes."""
        self.send_response(200)
        self.send_header("connection", "close")
        self.end_headers()
        for _ in range(10):
            self.wfile.write(b"\0" * 1000)

    def _slow(self) -> None:
        """Headers, then nothing until the server stops."""
        self.send_response(200)
        self.send_header("content-length", "10")
        self.end_headers()
        self.wfile.flush()
        self.release.wait(30)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def origin(files: dict[str, bytes]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 serving ``files`` by path (``/a.png``), and ``/redirect`` (to ``/a.png``),
    ``/loop`` (to itself), ``/to-file`` (to a file: URL), ``/big`` and ``/unsized`` (5,000 and 10,000 bytes of
    zeros), ``/slow`` (headers, then nothing); anything else is a 404. Yields its base URL."""
    release = threading.Event()
    handler = type("Handler", (_Handler,), {"files": files, "release": release})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
