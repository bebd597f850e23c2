"""The API keys a server takes, each with a name: ``--api-key`` (given more than once, each is named ``key-1``,
``key-2``, ... in order; each may call the admin routes, as the one key always could) and ``--api-keys-file`` (a JSON
file naming each key, whether it may call the admin routes, and the best priority its requests may ask for).

A key's name is what the server says of it: its usage in ``/metrics``, its fair share of the batch and the queue
(``engine.fairness``), its log entries. The key itself is kept only as a digest, and a request's key is found by
its digest, so that how long the lookup takes tells nothing of how much of a key matched.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import Headers

FIELDS = {"name", "key", "admin", "best_priority"}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class KeysError(ValueError):
    """The keys as given cannot be served; the message names the entry and what to change."""


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    admin: bool = True  # may call the admin routes (adapters, hosts)
    best_priority: int | None = None  # the lowest (soonest) ``priority`` its requests may ask for; None: any


class Keys:
    def __init__(self, keys: dict[str, Key]) -> None:
        """``keys``: each key's secret, to its ``Key``."""
        self._by_digest = {_digest(secret.encode()): key for secret, key in keys.items()}
        self.names = tuple(key.name for key in keys.values())

    def find(self, given: bytes) -> Key | None:
        """The key a request gave (``given_key``), or None when it is none of these."""
        return self._by_digest.get(_digest(given))


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def load(api_keys: str | None, keys_file: str | None) -> Keys | None:
    """The keys ``--api-key`` (its values comma-joined, as a repeated flag's are) and ``--api-keys-file`` give
    together, or None where neither gives any: the server asks no key."""
    keys: dict[str, Key] = {}
    given = [value.strip() for value in (api_keys or "").split(",") if value.strip()]
    for i, secret in enumerate(given, 1):
        _add(keys, secret, Key(f"key-{i}"), f"--api-key (value {i})")
    if keys_file is not None:
        for where, secret, key in _read(Path(keys_file)):
            _add(keys, secret, key, where)
    return Keys(keys) if keys else None


def _add(keys: dict[str, Key], secret: str, key: Key, where: str) -> None:
    if secret in keys:
        raise KeysError(f"{where}: the key is also {keys[secret].name!r}'s; give each key once")
    if key.name in (other.name for other in keys.values()):
        raise KeysError(f"{where}: the name {key.name!r} is taken by another key; give each key a name of its own")
    keys[secret] = key


def _read(path: Path) -> list[tuple[str, str, Key]]:
    """``--api-keys-file``: ``{"keys": [{"name": ..., "key": ..., "admin": false, "best_priority": null}]}``."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise KeysError(f"--api-keys-file {path}: cannot be read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KeysError(f"--api-keys-file {path}: not JSON ({e})") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise KeysError(
            f'--api-keys-file {path}: must be an object whose "keys" lists the keys, each '
            '{"name": NAME, "key": KEY, "admin": true|false, "best_priority": INTEGER}'
        )
    out = []
    for i, entry in enumerate(entries):
        where = f"--api-keys-file {path}, keys[{i}]"
        if not isinstance(entry, dict):
            raise KeysError(f'{where}: must be an object with "name" and "key"')
        if unknown := sorted(set(entry) - FIELDS):
            raise KeysError(
                f"{where}: unknown field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(FIELDS))}"
            )
        name, secret = entry.get("name"), entry.get("key")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise KeysError(f'{where}: "name" must be 1 to 64 letters, digits, ".", "_" or "-", got {name!r}')
        where = f"--api-keys-file {path}, key {name!r}"
        if not isinstance(secret, str) or not secret.strip() or secret != secret.strip() or "," in secret:
            raise KeysError(f'{where}: "key" must be a string with no spaces around it and no comma')
        admin, best = entry.get("admin", False), entry.get("best_priority")
        if not isinstance(admin, bool):
            raise KeysError(f'{where}: "admin" must be true or false, got {admin!r}')
        if best is not None and (isinstance(best, bool) or not isinstance(best, int)):
            raise KeysError(f'{where}: "best_priority" must be an integer (lower is sooner) or null, got {best!r}')
        out.append((where, secret, Key(name, admin, best)))
    return out


def given_key(headers: Headers) -> bytes:
    """The key a request carries, or b"": `Authorization: Bearer KEY`, `x-api-key: KEY` (Anthropic's clients), or
    HTTP Basic with the key as the password and any user name (what a browser asked by the page's challenge sends,
    and resends with the page's own requests)."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip().encode()
    if scheme.lower() == "basic":
        try:
            _, _, password = base64.b64decode(value.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            password = b""
        if password.strip():
            return password.strip()
    return headers.get("x-api-key", "").strip().encode()
