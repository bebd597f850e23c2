"""``neuron hosts``: the running leader's hosts, listed and reshaped through its admin routes (``server/hosts.py``).

``neuron hosts`` lists each rank's host and state, and the spares; ``neuron
hosts add HOST --ip IP`` adds a spare (an ssh destination and its data-plane
addresses); ``neuron hosts remove HOST`` forgets one; ``neuron hosts drain
HOST`` moves that host's ranks to spares while serving. The leader is found from
the same settings as ``serve`` reads (``--host``, ``--port`` and ``--api-key``
as ``NEURON_*`` variables or keys of its TOML file), or from ``--url``; the
key, where one is set, goes with every call. No MLX, no HTTP client library:
the standard library's is enough for three small calls.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

EXIT_REFUSED = 1
EXIT_USAGE = 2
TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 3600.0  # a drain loads the model on a spare: the leader's own --resume-timeout bounds it
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # a server on every address answers on loopback


class LeaderError(RuntimeError):
    """The leader could not be found, reached or asked; the message says what to do."""


def add_command(commands: Any) -> None:
    """``hosts`` and its actions, on the ``neuron`` command's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: an action's own parser must not reset what was given before the action's name.
    common.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help="the leader's address, e.g. http://10.0.0.1:8000 (default: from serve's settings, host and port)",
    )
    common.add_argument(
        "--config", metavar="PATH", default=argparse.SUPPRESS, help="serve's TOML file, to read its settings from"
    )
    hosts = commands.add_parser(
        "hosts", parents=[common], help="list the running leader's hosts and spares, or add or remove a spare"
    )
    actions = hosts.add_subparsers(dest="action", metavar="ACTION")
    add = actions.add_parser("add", parents=[common], help="add a spare host")
    add.add_argument("host", metavar="HOST", help="its ssh destination, e.g. me@mac3")
    add.add_argument("--ip", action="append", default=[], dest="ips", help="its data-plane address; repeat for several")
    add.add_argument("--model", help="the model's path on that host, where it differs from --model's")
    add.add_argument("--neuron", help="the command that starts neuron there")
    add.add_argument("--cpus", help="the cores its rank is pinned to, comma-separated")
    remove = actions.add_parser("remove", parents=[common], help="forget a spare host")
    remove.add_argument("host", metavar="HOST", help="the spare's ssh destination, as the hostfile gives it")
    drain = actions.add_parser(
        "drain", parents=[common], help="move a host's ranks to spares while serving, then stop its workers"
    )
    drain.add_argument("host", metavar="HOST", help="the host's ssh destination, as the hostfile gives it")


def leader(url: str | None, config: str | None) -> tuple[str, str | None]:
    """The leader's base URL and API key: ``url`` where given, else where serve's settings say it listens."""
    from neuron.config import sources

    settings = argparse.Namespace(config=config)
    if problems := sources.resolve(settings, "serve"):
        raise LeaderError("; ".join(problems))
    key = settings.api_key.split(",")[0].strip() if settings.api_key else None  # the first: each may call admin routes
    if url:
        return url.rstrip("/"), key
    if settings.port == 0:
        raise LeaderError("serve's port is 0 (a free one, picked as it starts): give the leader's --url")
    host = WILDCARDS.get(settings.host, settings.host)
    return f"http://{f'[{host}]' if ':' in host else host}:{settings.port}", key


def ask(
    base: str, key: str | None, path: str, body: dict[str, Any] | None = None, timeout: float = TIMEOUT_S
) -> dict[str, Any]:
    """One admin call; its JSON reply, or ``LeaderError`` with the leader's own reason."""
    headers = {"accept": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["content-type"] = "application/json"
    request = urllib.request.Request(f"{base}{path}", data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise LeaderError(f"the leader at {base} refused ({e.code}): {message}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise LeaderError(
            f"cannot reach the leader at {base} ({reason}): is `neuron serve` running there? give its --url, or "
            "the host and port it serves on (NEURON_HOST, NEURON_PORT, or --config)"
        ) from None


def entry(args: argparse.Namespace) -> dict[str, Any]:
    """``hosts add``'s flags as a hostfile entry; the leader checks it as it checks the hostfile's."""
    out: dict[str, Any] = {"ssh": args.host, "ips": args.ips}
    if args.model:
        out["model"] = args.model
    if args.neuron:
        out["neuron"] = args.neuron
    if args.cpus:
        try:
            out["cpus"] = [int(c) for c in args.cpus.split(",") if c.strip()]
        except ValueError:
            raise LeaderError(f"--cpus must list core numbers, comma-separated, got {args.cpus!r}") from None
    return out


def render(listing: dict[str, Any]) -> str:
    """The listing as a person reads it: a row per rank, then the spares, then where they are kept."""
    rows = [("rank", "host", "state")]
    for rank in listing["ranks"]:
        state = rank["state"] + (f" ({rank['reason']})" if rank.get("reason") else "")
        rows.append((str(rank["rank"]), rank["host"], state))
    rows += [("spare", spare["host"], spare["state"]) for spare in listing["spares"]] or [("spare", "(none)", "")]
    width = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{a:<{width[0]}}  {b:<{width[1]}}  {c}".rstrip() for a, b, c in rows]
    lines.append(f"hostfile: {listing['hostfile'] or '(none: started without --hosts)'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        base, key = leader(getattr(args, "url", None), getattr(args, "config", None))
        if args.action is None:
            print(render(ask(base, key, "/v1/hosts")))
            return 0
        if args.action == "add":
            done = ask(base, key, "/v1/hosts/add", entry(args))
        elif args.action == "remove":
            done = ask(base, key, "/v1/hosts/remove", {"host": args.host})
        else:  # the leader answers once the group serves again: a model loads meanwhile
            done = ask(base, key, "/v1/hosts/drain", {"host": args.host}, timeout=DRAIN_TIMEOUT_S)
    except LeaderError as e:
        print(f"neuron hosts: {e}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"{done['done']}; written to {done['hostfile']}")
    print(render(done))
    return 0
