"""``neuron serve`` with several models: the models declared (``router.declared``), each one's server command
made from this command's settings, and the router run. Reached before MLX is imported: a router loads none.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from neuron.config.settings import SETTINGS
from neuron.config.sources import CONFIG_ENV, names
from neuron.router.child import NOT_INHERITED, gib
from neuron.router.declared import Declared, conflicts, from_flags, from_tables

if TYPE_CHECKING:
    from neuron.launch.hosts import Host

# The router's own settings, or ones it sets for each model's server itself.
NOT_PASSED = ("model", "host", "port", "log_format", "api_key", "models_max", "keep_alive", "preload")
# served_model_name is each model's own: its name here (``server_flags``).


def several(args: argparse.Namespace) -> bool:
    """Whether this ``serve`` routes: more than one ``--model``, or ``[[models]]`` tables."""
    return bool(args.model_tables) or (args.model is not None and "," in args.model)


def declare(args: argparse.Namespace) -> tuple[list[Declared], list[str]]:
    """The models, and every problem with them at once."""
    keep_alive = None if args.keep_alive is None or args.keep_alive < 0 else args.keep_alive
    if args.model_tables:
        if args.model is not None:
            return [], ["give the models either as --model (or NEURON_MODEL) or as [[models]] tables, not both"]
        declared, problems = from_tables(args.model_tables, args.config_file, keep_alive)
        if args.preload:
            declared = [d if d.preload else _preloaded(d) for d in declared]
    else:
        sources = [source.strip() for source in args.model.split(",") if source.strip()]
        declared, problems = from_flags(sources, args.preload, keep_alive), []
    return declared, problems + conflicts(declared)


def server_flags(args: argparse.Namespace, model: Declared, at_once: int) -> list[str]:
    """``model``'s server's command line: every serve setting resolved here that is not its default, the model's
    own table's over the server's. The server reads no other layer (``server_env``). Of the memory, each server
    budgets its part: ``at_once`` models may be loaded together, each sizing its caches from as much."""
    own = dict(model.own) | {"memory_share": round(args.memory_share / at_once, 4), "served_model_name": model.name}
    flags: list[str] = []
    for name in names("serve"):
        value = own[name] if name in own else getattr(args, name)
        if name in NOT_PASSED or value is None or value is False or value == SETTINGS[name].default_for("serve"):
            continue
        flags += [SETTINGS[name].flag] if value is True else [SETTINGS[name].flag, str(value)]
    return flags


def at_once(args: argparse.Namespace, declared: list[Declared]) -> int:
    """How many models may be loaded together: ``--models-max``, else every one."""
    return min(args.models_max or len(declared), len(declared))


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """A model's server's environment: this one's, less every setting's variable (its flags say them all, its
    model's own over them) and what ties this process to systemd; the API keys, which no command line shows."""
    settings = {s.env for s in SETTINGS.values()} | {CONFIG_ENV}
    env = {k: v for k, v in os.environ.items() if k not in settings and k not in NOT_INHERITED}
    if args.api_key:
        env[SETTINGS["api_key"].env] = args.api_key
    return env


def overcommitted(args: argparse.Namespace, declared: list[Declared]) -> list[str]:
    """Models on this host that can never fit its memory: one alone, or those preloaded together (the others load
    on demand, and idle ones make room). Models whose weights are elsewhere or not known yet (a Hub name) are not
    counted."""
    from neuron.launch import cgroup
    from neuron.launch.hosts import total_memory
    from neuron.router.child import Child

    group = cgroup.own_group()
    total = total_memory(cgroup.room(group) if group else None)
    needs = {m.name: n for m in declared if (n := Child(m, [], {}, local_ranks(args, m)).need()) is not None}
    found = [
        f"the model {name!r} needs about {gib(need)} (its weights and its server), more than this host's "
        f"{gib(total)}: serve it over more hosts (hosts = ... in its [[models]] table), or a smaller quantization"
        for name, need in needs.items()
        if need > total
    ]
    preloaded = [(needs[m.name], m.name) for m in declared if m.preload and needs.get(m.name, total + 1) <= total]
    if len(preloaded) > 1 and sum(n for n, _ in preloaded) > total:
        names = ", ".join(repr(name) for _, name in preloaded)
        found.append(
            f"the models {names} are preloaded together but need about {gib(sum(n for n, _ in preloaded))}, "
            f"more than this host's {gib(total)}: preload fewer (the others load on their first request, and the "
            "least recently used idle one makes room)"
        )
    return found


def shared_hosts(
    args: argparse.Namespace, declared: list[Declared], memory_of: Callable[[Host], int | None]
) -> list[str]:
    """Entries whose hostfiles put ranks on one host beyond its memory (``memory_of``: its total, or None where it
    cannot be read, which the model's server then reports as it starts): the largest shares of the models that
    may be loaded at once, together. The router weighs only this host's memory before a load, so a host other
    entries share is checked here, at start."""
    from neuron.launch.hostfile import read_hostfile
    from neuron.launch.hosts import HostsError
    from neuron.router.child import need_bytes, weights_bytes

    on: dict[str, tuple[Host, dict[str, int]]] = {}
    for model in declared:
        path = dict(model.own).get("hosts") or args.hosts
        if not path or (weights := weights_bytes(model.source)) is None:
            continue
        try:
            hosts = read_hostfile(path).hosts
        except HostsError:
            continue  # its server says what is wrong with it as it starts
        for host in hosts:  # a rank each: an even share of the weights, a process
            shares = on.setdefault(host.ssh, (host, {}))[1]
            share = need_bytes(weights // len(hosts), 1)
            shares[model.name] = shares.get(model.name, 0) + share
    found = []
    for name, (host, shares) in on.items():
        if len(shares) < 2 or (total := memory_of(host)) is None:
            continue
        largest = sorted(shares.items(), key=lambda item: item[1])[-at_once(args, declared) :]
        if len(largest) > 1 and (need := sum(n for _, n in largest)) > total:
            names = ", ".join(repr(m) for m, _ in largest)
            found.append(
                f"the models {names} have ranks on the host {name} and may be loaded together, needing about "
                f"{gib(need)} there, more than its {gib(total)}: give them hosts apart, or set --models-max "
                f"{len(largest) - 1} (models_max), so that fewer are loaded at once"
            )
    return found


def host_memory(ssh_command: str, host: Host) -> int | None:
    """``host``'s total memory: this machine's, or another's over SSH (``/proc/meminfo``); None where unread."""
    from neuron.launch.cgroup import own_group, room
    from neuron.launch.hosts import total_memory
    from neuron.launch.ssh import SSH_OPTIONS

    if host.local:
        group = own_group()
        return total_memory(room(group) if group else None)
    argv = [*shlex.split(ssh_command), *SSH_OPTIONS, "--", host.ssh, "cat /proc/meminfo"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=15, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in done.stdout.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def local_ranks(args: argparse.Namespace, model: Declared) -> int | None:
    """How many ranks ``model``'s server runs on this host: all of them, or None where a hostfile places them."""
    own = dict(model.own)
    if own.get("hosts") or (args.hosts and "hosts" not in own):
        return None
    return int(own.get("tp") or args.tp or 1) * int(own.get("pp") or args.pp or 1)


def _preloaded(model: Declared) -> Declared:
    return Declared(model.name, model.source, model.own, True, model.keep_alive)


def problems(args: argparse.Namespace) -> list[str]:
    """Everything wrong with the models and the keys, at once, before anything starts."""
    from neuron.models.folder import outside
    from neuron.server.keys import KeysError, load

    declared, found = declare(args)
    found += [problem for model in declared if (problem := outside(model.source, args.model_dirs))]
    found += overcommitted(args, declared)
    found += shared_hosts(args, declared, lambda host: host_memory(args.ssh_command, host))
    try:
        load(args.api_key, args.api_keys_file)
    except KeysError as e:
        found.append(str(e))
    return found


def run(args: argparse.Namespace) -> int:
    import anyio

    from neuron import log as logging_setup
    from neuron.config.settings import HttpLimits
    from neuron.config.sources import build
    from neuron.launch import cgroup
    from neuron.launch.hosts import free_memory
    from neuron.router.app import Router
    from neuron.router.child import Child
    from neuron.router.fleet import Fleet
    from neuron.router.run import serve
    from neuron.server.keys import load
    from neuron.server.listener import ListenError

    logging_setup.configure(args.log_level, args.log_format)
    declared, _ = declare(args)
    env = server_env(args)
    together = at_once(args, declared)
    children = [
        Child(m, server_flags(args, m, together), env, local_ranks(args, m), args.drain_timeout) for m in declared
    ]
    group = cgroup.own_group()
    fleet = Fleet(
        children, args.models_max, args.max_waiting, lambda: free_memory(cgroup.room(group) if group else None)
    )
    router = Router(fleet, load(args.api_key, args.api_keys_file))
    try:
        anyio.run(serve, router, fleet, args.host, args.port, build(HttpLimits, args))
    except ListenError as e:
        print(f"neuron: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
