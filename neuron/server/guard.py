"""What a request must be before any route sees it: from an allowed origin, for an allowed host, JSON where a
route reads JSON, and framed one way only. No MLX.

Why: a server with no API key on loopback is reachable from every web page its
user visits. A page can POST a body as ``text/plain``, which needs no CORS
preflight, so the model would run for it (hence 415 for anything but JSON); and
a DNS-rebinding page, whose own name resolves to 127.0.0.1, can read the
answers, which only the ``Host`` header it sends gives away. Ollama refuses
both the same way (``OLLAMA_ORIGINS``).

Allowed without a setting: no ``Origin`` (what non-browser clients, the OpenAI
SDKs among them, send), a page served from loopback (``http://localhost:3000``,
``http://127.0.0.1``, ``http://[::1]``), and a ``Host`` that is an IP address (a
rebinding page cannot send one), ``localhost``, or this machine's name. The
settings add patterns, ``*`` standing for any run of characters.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import orjson
import structlog
from starlette.types import ASGIApp, Receive, Scope, Send

log = structlog.get_logger("neuron.server")

LOOPBACK_ORIGINS = ("http://localhost", "https://localhost", "http://127.0.0.1", "https://127.0.0.1")
LOOPBACK_ORIGINS_V6 = ("http://[::1]", "https://[::1]")
JSON_MEDIA_TYPES = ("application/json",)


def _pattern(patterns: Iterable[str]) -> re.Pattern[str]:
    """One regex matching any of ``patterns`` whole, case-insensitively; ``*`` matches any run of characters."""
    alternatives = [".*".join(map(re.escape, p.strip().split("*"))) for p in patterns if p.strip()]
    return re.compile("|".join(f"(?:{a})" for a in alternatives) or "(?!)", re.IGNORECASE)


def split_list(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


@dataclass(frozen=True, slots=True)
class Allowed:
    """Which origins and hosts requests may come from and for."""

    origins: re.Pattern[str]
    hosts: re.Pattern[str]
    names: frozenset[str]  # this machine's names and the one the server was told to listen on

    @classmethod
    def build(cls, origins: Iterable[str] = (), hosts: Iterable[str] = (), listen: str | None = None) -> Allowed:
        loopback = [f"{o}{port}" for o in (*LOOPBACK_ORIGINS, *LOOPBACK_ORIGINS_V6) for port in ("", ":*")]
        names = {"localhost", socket.gethostname().lower(), socket.getfqdn().lower()}
        if listen:
            names.add(listen.lower())
        return cls(_pattern([*loopback, *origins]), _pattern(["*.localhost", *hosts]), frozenset(names))

    def origin(self, origin: str) -> bool:
        return self.origins.fullmatch(origin) is not None

    def host(self, host: str) -> bool:
        name = host.strip().lower()
        if name.startswith("["):  # [v6]:port
            name = name[1 : name.find("]")] if "]" in name else name
        elif name.count(":") == 1:
            name = name.split(":", 1)[0]
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        return name in self.names or self.hosts.fullmatch(name) is not None


def _refusal(status: int, message: str, code: str, close: bool = False) -> tuple[dict, dict]:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    start = {"type": "http.response.start", "status": status, "headers": headers}
    return start, {"type": "http.response.body", "body": body, "more_body": False}


class Guard:
    """ASGI middleware: refuses, in OpenAI's error body, what ``Allowed`` and the JSON routes do not take."""

    def __init__(self, app: ASGIApp, allowed: Allowed, json_paths: Iterable[str]) -> None:
        self.app = app
        self.allowed = allowed
        self.json_paths = frozenset(json_paths)

    def problem(self, scope: Scope) -> tuple[int, str, str] | None:
        """(status, message, code) of why the request is refused, or None."""
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.lower(), []).append(value)
        if b"content-length" in headers and b"transfer-encoding" in headers:
            # RFC 9112 6.1: a request framed both ways may be smuggling a second one; answer it and close.
            message = "the request has both Content-Length and Transfer-Encoding; send one"
            return 400, message, "ambiguous_framing"
        host = headers.get(b"host", [b""])[0].decode("latin-1")
        if host and not self.allowed.host(host):
            message = (
                f"the host {host!r} is not one this server answers to; list it in the allowed_hosts setting "
                "(NEURON_ALLOWED_HOSTS), or connect by IP address"
            )
            return 403, message, "host_not_allowed"
        origin = headers.get(b"origin", [b""])[0].decode("latin-1")
        if origin and not self.allowed.origin(origin):
            message = (
                f"requests from web pages at {origin!r} are not allowed; list the origin in the allowed_origins "
                "setting (NEURON_ALLOWED_ORIGINS)"
            )
            return 403, message, "origin_not_allowed"
        if scope["method"] == "POST" and scope["path"] in self.json_paths:
            given = headers.get(b"content-type")
            kind = given[0].decode("latin-1").split(";", 1)[0].strip().lower() if given else None
            # None is read as JSON: only a browser could abuse that, and a browser's cross-site request has an Origin.
            if kind is not None and kind not in JSON_MEDIA_TYPES:
                message = f"the body must be JSON, sent with `Content-Type: application/json`, not {kind!r}"
                return 415, message, "unsupported_media_type"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (problem := self.problem(scope)) is not None:
            status, message, code = problem
            log.info("request refused", path=scope["path"], status=status, code=code, error=message)
            start, body = _refusal(status, message, code, close=status == 400)
            await send(start)
            await send(body)
            return
        await self.app(scope, receive, send)


def loopback(address: str | None) -> bool:
    """Whether a client's address is this machine's loopback (127.0.0.0/8, ::1, or v4 mapped in v6)."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
