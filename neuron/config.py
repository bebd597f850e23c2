"""Every option of ``neuron serve`` and ``neuron generate``, defined once, and where each value comes from.

For ``serve``, a value comes from the first of: the command line, the
environment (``NEURON_`` + the name in capitals, e.g. ``NEURON_MAX_BATCH``),
the TOML file (``--config``, else ``$NEURON_CONFIG``, else
``/etc/neuron/neuron.toml`` when it exists), the default. A packaged server is
configured in its file, a container in its environment, and a person trying
something on the command line; each overrides the one before.

``generate`` reads only its command line: a one-off run should not pick up a
server's settings by surprise.

Every value is checked here, before anything loads, and every problem is
reported at once, named by where it came from (``--port``, ``NEURON_PORT``,
``port in /etc/neuron/neuron.toml``).
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron.engine.scheduler import Scheduling
from neuron.models import POOLING_TYPES

DEFAULT_CONFIG = Path("/etc/neuron/neuron.toml")
CONFIG_ENV = "NEURON_CONFIG"
ENV_PREFIX = "NEURON_"
DEFAULTS = Scheduling()  # the engine settings' defaults are stated once, on ``Scheduling``


def _at_least(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be at least {low}, got {v}"


def _positive(v: float) -> str | None:
    return None if v > 0 else f"must be positive, got {v}"


def _port(v: int) -> str | None:
    return None if 0 <= v <= 65535 else f"must lie in [0, 65535], got {v}"


def _not_blank(v: str) -> str | None:
    return None if v.strip() else "is empty; give a value or leave it unset"


def _absolute_paths(v: str) -> str | None:
    relative = [p for p in v.split(":") if not os.path.isabs(p)]
    return (
        f"must list absolute directories separated by ':', got {', '.join(map(repr, relative))}" if relative else None
    )


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    check: Callable[[Any], str | None] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def parse(self, value: Any, source: str, text: bool = False) -> tuple[Any, str | None]:
        """``value`` as this setting's type (converted from ``text``, the environment's strings), or a problem."""
        if text and self.type is bool:
            value = _BOOLEANS.get(value.strip().lower(), value)
        elif text and self.type is not str:
            try:
                value = self.type(value)
            except ValueError:
                return None, f"{source} must be {_type_name(self.type)}, got {value!r}"
        if self.type is float and type(value) is int:
            value = float(value)
        if type(value) is not self.type:
            return None, f"{source} must be {_type_name(self.type)}, got {value!r}"
        if self.choices and value not in self.choices:
            return None, f"{source} must be one of {', '.join(self.choices)}, got {value!r}"
        if self.check is not None and (problem := self.check(value)) is not None:
            return None, f"{source} {problem}"
        return value, None


_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _type_name(t: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false (1 or 0)"}[t]


LOG_LEVELS = ("trace", "debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console", "journal")

SETTINGS = {
    s.name: s
    for s in (
        Setting("model", str, None, "model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)"),
        Setting("tp", int, None, "tensor-parallel ranks (default: one per --hosts entry, else 1)", check=_at_least(1)),
        Setting(
            "pp",
            int,
            1,
            "pipeline stages: the model's layers split into this many runs of whole layers, one per rank (default 1)",
            check=_at_least(1),
        ),
        Setting(
            "pp_layers",
            str,
            None,
            "layers per pipeline stage, e.g. 10,20 (default: in proportion to each host's free memory)",
            check=_not_blank,
        ),
        Setting(
            "micro_batches",
            int,
            DEFAULTS.micro_batches,
            "decode passes per step, so that pipeline stages work at the same time "
            f"(default {DEFAULTS.micro_batches}: decode reads every weight once per pass, and on memory-bound hosts a "
            "second pass costs more than the overlap buys)",
            check=_at_least(1),
        ),
        Setting(
            "hosts",
            str,
            None,
            "hostfile (mlx.launch's JSON: one entry per rank, entry 0 this host) to split the model over other "
            "hosts, started over SSH (unset: every rank on this host)",
        ),
        Setting(
            "ssh_command",
            str,
            "ssh",
            "the ssh command for --hosts, with its options, e.g. 'ssh -F /etc/neuron/ssh_config' (default ssh)",
            check=_not_blank,
        ),
        Setting(
            "push_model",
            bool,
            False,
            "with --hosts, send a host that lacks the model (or holds another) the share its ranks load, over SSH, "
            "into its neuron cache (default off: such a host is refused)",
        ),
        Setting(
            "backend",
            str,
            "ring",
            "mx.distributed backend for --tp > 1 (default ring; jaccl and nccl untested here)",
            ("ring", "jaccl", "nccl"),
        ),
        Setting(
            "data_plane",
            str,
            "direct",
            "how the ring's links between hosts travel: direct (plain TCP between the hostfile's ips; keep it on a "
            "private link) or ssh (each link tunnelled through the leader's SSH connections, encrypted; default "
            "direct)",
            ("direct", "ssh"),
        ),
        Setting(
            "step_timeout",
            float,
            120.0,
            "seconds a step may take on any rank before it is declared lost (default 120)",
            check=_positive,
        ),
        Setting("log_level", str, "info", "trace is one event per step (default info)", LOG_LEVELS),
        Setting(
            "log_format",
            str,
            "auto",
            "auto: the journal under systemd, readable on a terminal, JSON lines otherwise (default auto)",
            LOG_FORMATS,
        ),
        Setting(
            "model_dirs",
            str,
            None,
            "directories, ':'-separated, that --model must lie in once symlinks are followed (unset: anywhere)",
            check=_absolute_paths,
        ),
        Setting("host", str, "127.0.0.1", "address to listen on (default 127.0.0.1, loopback only)"),
        Setting("port", int, 8000, "TCP port (default 8000; 0 picks a free one)", check=_port),
        Setting(
            "api_key",
            str,
            None,
            "require `Authorization: Bearer KEY` on /v1 (unset: no key)",
            check=_not_blank,
        ),
        Setting(
            "allowed_origins",
            str,
            None,
            "web pages, comma-separated, that browsers may call the API from besides loopback ones, `*` matching "
            "anything, e.g. https://*.example.com (unset: loopback pages only; `*`: any)",
            check=_not_blank,
        ),
        Setting("no_page", bool, False, "serve no page at / (default: a chat and the cluster's status, for browsers)"),
        Setting(
            "allowed_hosts",
            str,
            None,
            "names, comma-separated, the server answers to in the Host header besides IP addresses, localhost and "
            "this machine's name, `*` matching anything (unset: those only; `*`: any)",
            check=_not_blank,
        ),
        Setting(
            "max_connections",
            int,
            1024,
            "open HTTP connections; past it a new one closes the oldest idle one, or gets 503 when none is idle "
            "(default 1024, and at most the descriptor limit less 128)",
            check=_at_least(1),
        ),
        Setting(
            "header_timeout",
            float,
            10.0,
            "seconds a connection has to send a request's head, from connecting or from its first byte (default 10)",
            check=_positive,
        ),
        Setting(
            "keep_alive_timeout",
            float,
            5.0,
            "seconds an idle connection stays open between requests (default 5)",
            check=_positive,
        ),
        Setting(
            "max_batch",
            int,
            DEFAULTS.max_batch,
            f"sequences decoding together (default {DEFAULTS.max_batch})",
            check=_at_least(1),
        ),
        Setting(
            "max_n",
            int,
            DEFAULTS.max_n,
            f"choices per request (n), at most --max-batch; more get 400 (default {DEFAULTS.max_n})",
            check=_at_least(1),
        ),
        Setting(
            "max_waiting",
            int,
            DEFAULTS.max_waiting,
            f"requests queued beyond the batch; more get 429 (default {DEFAULTS.max_waiting})",
            check=_at_least(0),
        ),
        Setting(
            "prefill_chunk",
            int,
            DEFAULTS.prefill_chunk,
            "prompt tokens fed per step, so long prompts do not stall running streams "
            f"(default {DEFAULTS.prefill_chunk})",
            check=_at_least(1),
        ),
        Setting(
            "max_context",
            int,
            DEFAULTS.max_context,
            "tokens per request, prompt and completion (default: the model's context)",
            check=_at_least(1),
        ),
        Setting(
            "prefix_cache_bytes",
            int,
            DEFAULTS.prefix_cache_bytes,
            "bytes of KV cache per rank kept for prompts' shared beginnings, reused by later prompts that start "
            f"the same way (default {DEFAULTS.prefix_cache_bytes / (1 << 30):g} GiB; 0 turns the prefix cache off)",
            check=_at_least(0),
        ),
        Setting(
            "speculate",
            str,
            DEFAULTS.speculate,
            "speculative decoding without a draft model: draft tokens from prompt lookup and requests' "
            f"`prediction`, verified in the batched step (default {DEFAULTS.speculate}; off: none)",
            choices=("ngram", "off"),
        ),
        Setting(
            "run_ahead",
            str,
            DEFAULTS.run_ahead,
            "in steady decode, queue each step on the device before reading the last one's tokens, so that the "
            f"device never waits for the host (default {DEFAULTS.run_ahead}: on a GPU, off on a CPU, where MLX "
            "evaluates in the caller)",
            choices=("auto", "on", "off"),
        ),
        Setting(
            "resume_timeout",
            float,
            DEFAULTS.resume_timeout,
            "seconds the requests in flight when a rank is lost wait for fresh workers, then go on where they "
            f"stopped; 0: they fail at once and the leader restarts (default {DEFAULTS.resume_timeout:g})",
            check=_at_least(0),
        ),
        Setting(
            "resume_tries",
            int,
            DEFAULTS.resume_tries,
            "losses of a rank a request may be blamed for (fed when it happened) and still go on; the next ends "
            f"it with an error, as it may be what kills the rank (default {DEFAULTS.resume_tries})",
            check=_at_least(0),
        ),
        Setting(
            "pooling_type",
            str,
            DEFAULTS.pooling_type,
            "how /v1/embeddings pools the final hidden states, vLLM's pooling types: MEAN over every position, or "
            "the LAST position's (default: what the model's sentence-transformers card says, else MEAN)",
            choices=POOLING_TYPES,
        ),
        Setting(
            "drain_timeout",
            float,
            30.0,
            "seconds SIGTERM lets running requests finish before ending them with an error (default 30)",
            check=_at_least(0),
        ),
    )
}

MODEL_SETTINGS = (
    "model",
    "tp",
    "pp",
    "pp_layers",
    "hosts",
    "ssh_command",
    "push_model",
    "backend",
    "data_plane",
    "step_timeout",
    "log_level",
    "log_format",
)
SERVE_SETTINGS = (
    *MODEL_SETTINGS,
    "model_dirs",
    "host",
    "port",
    "api_key",
    "allowed_origins",
    "no_page",
    "allowed_hosts",
    "max_connections",
    "header_timeout",
    "keep_alive_timeout",
    "max_batch",
    "max_n",
    "max_waiting",
    "prefill_chunk",
    "max_context",
    "micro_batches",
    "prefix_cache_bytes",
    "speculate",
    "run_ahead",
    "resume_timeout",
    "resume_tries",
    "pooling_type",
    "drain_timeout",
)


def add_arguments(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """Flags default to None, so that ``resolve`` can tell a flag given from one left out."""
    for name in names:
        s = SETTINGS[name]
        if s.type is bool:  # a switch: given, it is on; the environment and the file say true or false
            parser.add_argument(s.flag, action="store_const", const=True, default=None, help=s.help)
            continue
        parser.add_argument(
            s.flag,
            type=s.type,
            default=None,
            choices=s.choices or None,
            help=s.help + (f"; one of {', '.join(s.choices)}" if s.choices else ""),
            metavar=s.name.upper(),
        )


def resolve(args: argparse.Namespace, names: Iterable[str], layered: bool) -> list[str]:
    """Fill each setting on ``args`` from its layers (see the module's docstring); returns every problem found."""
    problems: list[str] = []
    file: dict[str, Any] = {}
    file_name = ""
    if layered:
        path, explicit = _config_path(getattr(args, "config", None))
        if path is not None:
            file_name = str(path)
            file, problem = _read_toml(path, explicit)
            if problem:
                return [problem]
            known = set(names)
            for key in file:
                if key not in known:
                    problems.append(f"unknown setting {key!r} in {path}; known: {', '.join(sorted(known))}")
    for name in names:
        s = SETTINGS[name]
        # Every layer is checked, not only the one that wins: a bad line in the file is a bug even when overridden.
        layers = []
        if (cli := getattr(args, name, None)) is not None:
            layers.append(s.parse(cli, s.flag))
        if layered and s.env in os.environ:
            layers.append(s.parse(os.environ[s.env], s.env, text=True))
        if name in file:
            layers.append(s.parse(file[name], f"{name} in {file_name}"))
        problems += [problem for _, problem in layers if problem]
        setattr(args, name, layers[0][0] if layers else s.default)
    return problems


def _config_path(flag: str | None) -> tuple[Path | None, bool]:
    if flag:
        return Path(flag), True
    if env := os.environ.get(CONFIG_ENV):
        return Path(env), True
    return (DEFAULT_CONFIG, False) if DEFAULT_CONFIG.exists() else (None, False)


def _read_toml(path: Path, explicit: bool) -> tuple[dict[str, Any], str | None]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f), None
    except FileNotFoundError:
        if not explicit:
            return {}, None
        return {}, f"config file {path} does not exist; pass an existing --config or leave it out"
    except OSError as e:
        return {}, f"cannot read config file {path}: {e.strerror}"
    except tomllib.TOMLDecodeError as e:
        return {}, f"config file {path} is not valid TOML: {e}"
