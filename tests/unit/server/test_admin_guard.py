"""Who may call an admin route (``http.authorize_admin``), through the real app in process: the API key where one
is set; with none, a client on loopback only. The refusals say what to do; a refused call never reaches the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from neuron.server.app import ServerState, build_app, describe, endpoints
from neuron.server.http import loopback, open_to_others
from neuron.server.keys import load

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
HOSTS = "/v1/hosts"
ADD, REMOVE, DRAIN = f"{HOSTS}/add", f"{HOSTS}/remove", f"{HOSTS}/drain"
BODIES = {
    LOAD: {"lora_name": "a", "lora_path": "/adapters/a"},
    UNLOAD: {"lora_name": "a"},
    HOSTS: None,  # a GET
    ADD: {"ssh": "me@mac3", "ips": ["10.0.0.3"]},
    REMOVE: {"host": "me@mac3"},
    DRAIN: {"host": "me@mac2"},
}
# Every route that changes what is served, or where (or lists the hosts): each must be an admin route, and none
# other is.
ADMIN_ROUTES = set(BODIES)
REMOTE = ("10.1.2.3", 40000)
LOCAL = ("127.0.0.1", 40000)


class Adapters:
    """What the adapter routes call on the engine: it records, and loads nothing."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.calls: list[tuple[str, ...]] = []

    async def load(self, name: str, path: str) -> None:
        self.calls.append(("load", name, path))

    async def unload(self, name: str) -> None:
        self.calls.append(("unload", name))


class Roster:
    """What the hosts' routes call on the pool: it records, and changes nothing."""

    def __init__(self, calls: list[tuple[str, ...]]) -> None:
        self.calls = calls
        self.path = None

    async def add(self, entry: dict) -> SimpleNamespace:
        self.calls.append(("add", entry["ssh"]))
        return SimpleNamespace(ssh=entry["ssh"])

    def remove(self, ssh: str) -> SimpleNamespace:
        self.calls.append(("remove", ssh))
        return SimpleNamespace(ssh=ssh)


class Drains:
    """What the drain route calls on the engine: it records, and moves nothing."""

    def __init__(self, calls: list[tuple[str, ...]]) -> None:
        self.calls = calls

    async def drain(self, host: str) -> str:
        self.calls.append(("drain", host))
        return host

    def said(self, drained: str) -> str:
        return f"drained {drained}"


@pytest.fixture
def adapters() -> Adapters:
    return Adapters()


def client(
    adapters: Adapters, key: str | None, address: tuple[str, int], keys_file: Path | None = None
) -> Iterator[TestClient]:
    spares = SimpleNamespace(describe=lambda: [])
    pool = SimpleNamespace(hosts=["localhost"], broken=None, loaded=True, spares=spares, roster=Roster(adapters.calls))
    engine = SimpleNamespace(adapters=adapters, pool=pool, drains=Drains(adapters.calls))
    state = ServerState("qwen3", keys=load(key, keys_file and str(keys_file)), engine=engine)  # type: ignore[arg-type]
    with TestClient(build_app(state), raise_server_exceptions=False, base_url="http://127.0.0.1", client=address) as c:
        yield c


def call(c: TestClient, path: str, headers: dict[str, str] | None = None) -> Any:
    """The route as ``neuron hosts`` or a client calls it: a GET where it takes no body."""
    if BODIES[path] is None:
        return c.get(path, headers=headers)
    return c.post(path, json=BODIES[path], headers=headers)


@pytest.mark.parametrize("path", sorted(ADMIN_ROUTES))
def test_with_no_key_a_loopback_client_is_served_and_another_is_refused_saying_what_to_do(
    adapters: Adapters, path: str
) -> None:
    for c in client(adapters, None, LOCAL):
        assert call(c, path).status_code == 200
    calls = len(adapters.calls)
    for c in client(adapters, None, REMOTE):
        response = call(c, path)
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "admin_needs_key" and "--api-key" in error["message"] and "10.1.2.3" in error["message"]
    assert len(adapters.calls) == calls  # the refused call changed nothing


@pytest.mark.parametrize("address", [LOCAL, REMOTE], ids=["loopback", "remote"])
@pytest.mark.parametrize("path", sorted(ADMIN_ROUTES))
def test_with_a_key_set_every_client_needs_it_loopback_too(
    adapters: Adapters, path: str, address: tuple[str, int]
) -> None:
    for c in client(adapters, "secret", address):
        missing = call(c, path)
        wrong = call(c, path, {"authorization": "Bearer nope"})
        assert adapters.calls == []
        right = call(c, path, {"authorization": "Bearer secret"})
    assert missing.status_code == 401 and "Authorization: Bearer KEY" in missing.json()["error"]["message"]
    assert wrong.status_code == 401 and right.status_code == 200, (wrong.text, right.text)


def test_a_generation_route_stays_open_to_a_remote_client_with_no_key(adapters: Adapters) -> None:
    """Only admin routes are narrowed: with no key, the API itself answers anyone (the operator's choice)."""
    for c in client(adapters, None, REMOTE):
        assert c.get("/v1/models").status_code != 403


def test_the_admin_routes_are_exactly_those_that_reshape_the_server_and_the_openapi_document_tags_them() -> None:
    admin = {e.path for e in endpoints() if e.admin}
    assert admin == ADMIN_ROUTES
    paths = describe("qwen3")["paths"]
    for path in ADMIN_ROUTES:
        (operation,) = paths[path].values()
        assert operation["tags"] == ["admin"] and "loopback" in operation["description"], operation
        assert {"401", "403"} <= set(operation["responses"]), operation["responses"]
    assert not any("admin" in op.get("tags", ()) for p, ops in paths.items() if p not in admin for op in ops.values())


@pytest.mark.parametrize(
    ("address", "local"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.2", False),
        ("::ffff:10.0.0.2", False),
        ("fe80::1%eth0", False),
        ("testclient", False),
        ("", False),
        (None, False),
    ],
)
def test_loopback_is_what_only_this_machine_can_send_from(address: str | None, local: bool) -> None:
    assert loopback(address) is local


@pytest.mark.parametrize(
    ("address", "api_key", "open_"),
    [
        ("0.0.0.0", None, True),  # every interface
        ("::", None, True),
        ("192.168.1.5", None, True),  # one interface's address
        ("0.0.0.0", "sesame", False),  # a key closes it
        ("127.0.0.1", None, False),
        ("::1", None, False),
        ("::ffff:127.0.0.1", None, False),
    ],
)
def test_a_listener_is_open_to_others_beyond_loopback_without_a_key(
    address: str, api_key: str | None, open_: bool
) -> None:
    assert open_to_others(address, load(api_key, None)) is open_


@pytest.mark.parametrize("path", sorted(ADMIN_ROUTES))
def test_the_keys_file_says_which_keys_may_call_admin_routes(adapters: Adapters, path: str, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    keys = [{"name": "ops", "key": "ops-secret", "admin": True}, {"name": "agents", "key": "agent-secret"}]
    keys_file.write_text(json.dumps({"keys": keys}))
    for c in client(adapters, None, LOCAL, keys_file):
        refused = call(c, path, {"authorization": "Bearer agent-secret"})
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "admin_needs_key" and "'agents' may not call it" in error["message"]
        assert not adapters.calls  # the refused call changed nothing
        assert call(c, path, {"authorization": "Bearer ops-secret"}).status_code == 200
        assert call(c, path).status_code == 401  # loopback or not, a keyed server asks a key
