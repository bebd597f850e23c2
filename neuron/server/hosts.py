"""The hosts' admin routes, which ``neuron hosts`` talks to: ``GET /v1/hosts`` (each rank's host and state, and the
spares), ``POST /v1/hosts/add`` (a spare, its body a hostfile entry), ``POST /v1/hosts/remove`` (``{"host"}``: a
spare forgotten) and ``POST /v1/hosts/drain`` (``{"host"}``: its ranks moved to spares at a step boundary; it
answers once the group serves again). Admin routes (``http.authorize_admin``): the API key, or with none set a
loopback client. What they change is written back to the hostfile (``pool/roster.py``). No MLX.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from neuron.server.common.errors import ApiError
from neuron.server.common.fields import an_object, bad
from neuron.server.common.readiness import rank_state
from neuron.server.common.schema import ADMIN, OpenApi, Schema, Spec, admin_post, get, ref, replies
from neuron.server.http import Call, Endpoint, OrjsonResponse

if TYPE_CHECKING:
    from neuron.engine.engine import Engine


def listing(engine: Engine) -> dict[str, Any]:
    """Each rank's host and state, the spares in the order they are taken, and the file they are kept in."""
    pool = engine.pool
    broken = pool.broken
    ranks = []
    for rank, host in enumerate(pool.hosts):
        state, reason = rank_state(rank, broken.failures if broken is not None else None, pool.loaded)
        ranks.append({"rank": rank, "host": host, "state": state, "reason": reason})
    path = pool.roster.path
    return {"ranks": ranks, "spares": pool.spares.describe(), "hostfile": str(path) if path else None}


async def _changed(call: Call, change: Callable[[Engine], Awaitable[str]]) -> Response:
    """``change`` run on the engine; its refusal (a ``HostsError``, which says what to fix and carries its status
    where it is not 400) as an error reply. The server may not import the pool's types: it reads the status."""
    engine = call.engine
    try:
        done = await change(engine)
    except ValueError as e:
        status = getattr(e, "status", 400)
        raise ApiError(status, str(e), code="hosts_refused" if status != 404 else "not_found") from None
    return OrjsonResponse({"done": done, **listing(engine)})


def _host(body: Any) -> str:
    body = an_object(body)
    name = body.get("host")
    if set(body) != {"host"} or not isinstance(name, str) or not name.strip():
        raise bad("host", "the body is {`host`: the host's ssh name, as the hostfile gives it}")
    return name.strip()


async def list_hosts(call: Call) -> Response:
    return OrjsonResponse(listing(call.engine))


async def add_host(call: Call) -> Response:
    entry = an_object(call.body)

    async def add(engine: Engine) -> str:
        return f"added the spare {(await engine.pool.roster.add(entry)).ssh}"

    return await _changed(call, add)


async def remove_host(call: Call) -> Response:
    name = _host(call.body)

    async def remove(engine: Engine) -> str:
        return f"removed the spare {engine.pool.roster.remove(name).ssh}"

    return await _changed(call, remove)


async def drain_host(call: Call) -> Response:
    name = _host(call.body)

    async def drain(engine: Engine) -> str:
        return engine.drains.said(await engine.drains.drain(name))

    return await _changed(call, drain)


ENDPOINTS = (
    Endpoint("/v1/hosts", list_hosts, method="GET", admin=True),
    Endpoint("/v1/hosts/add", add_host, strict_json=True, admin=True),
    Endpoint("/v1/hosts/remove", remove_host, strict_json=True, admin=True),
    Endpoint("/v1/hosts/drain", drain_host, strict_json=True, admin=True),
)


def openapi(spec: Spec) -> OpenApi:
    text: Schema = {"type": "string", "minLength": 1}
    entry: Schema = {
        "type": "object",
        "description": "a hostfile entry: an ssh destination and its data-plane addresses, with neuron's optional keys",
        "required": ["ssh"],
        "properties": {
            "ssh": text,
            "ips": {"type": "array", "items": text},
            "rdma": {"type": "array"},
            "neuron": text,
            "model": text,
            "cpus": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
        "additionalProperties": False,
    }
    listed: Schema = {
        "type": "object",
        "required": ["ranks", "spares", "hostfile"],
        "properties": {
            "done": {"type": "string"},
            "ranks": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["rank", "host", "state"],
                    "properties": {
                        "rank": {"type": "integer"},
                        "host": {"type": "string"},
                        "state": {"enum": ["ok", "starting", "lost"]},
                        "reason": {"type": ["string", "null"]},
                    },
                },
            },
            "spares": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["host", "state"],
                    "properties": {"host": {"type": "string"}, "state": {"enum": ["standing by", "returning"]}},
                },
            },
            "hostfile": {"type": ["string", "null"]},
        },
    }
    remove: Schema = {
        "type": "object",
        "required": ["host"],
        "properties": {"host": text},
        "additionalProperties": False,
    }
    changed = replies(400, 401, 403, 404, 409, 413, 415, 422, 503, ok=ref("Hosts"))
    listing_op = get(
        "the ranks' hosts and states, and the spares",
        replies(401, 403, 503, ok=ref("Hosts")),
        tags=["admin"],
        description=ADMIN,
        **spec.secured,
    )
    return {
        "/v1/hosts": listing_op,
        "/v1/hosts/add": admin_post(spec, "add a spare host", entry, changed),
        "/v1/hosts/remove": admin_post(spec, "forget a spare host", remove, changed),
        "/v1/hosts/drain": admin_post(
            spec,
            "move a host's ranks to spares at a step boundary; answers once the group serves again",
            remove,
            changed,
        ),
    }, {"Hosts": listed}
