"""The docs' reference pages, written from the code they describe, so that none can drift from it.

The docs build (scripts/docs_hooks.py) adds each page as it builds the site; nothing
here is committed as Markdown. ``python -m neuron.cli.reference settings`` prints one.
No MLX: the HTTP routes come from the OpenAPI document the server serves.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any

from prometheus_client.metrics_core import Metric

from neuron import metrics, rpc
from neuron.config.setting import Setting
from neuron.config.settings import GROUPS, SETTINGS, title
from neuron.models import architectures
from neuron.router.metrics import RouterMetrics

_TYPES = {int: "integer", float: "number", str: "string", bool: "switch"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _first_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    if doc.startswith(f"{getattr(obj, '__name__', '')}("):  # a dataclass's generated signature says nothing more
        return ""
    return doc.split("\n\n")[0].replace("\n", " ")


def settings_page() -> str:
    out = [
        "# Settings",
        "",
        "Every setting of `neuron serve` and `neuron generate`. `serve` takes each from the first of: its flag, its "
        "`NEURON_*` environment variable, its key in the TOML file (`--config`, else `$NEURON_CONFIG`, else "
        "`/etc/neuron/neuron.toml` when it exists), the default. `generate` reads only its flags.",
        "",
        "A bad value stops the command before anything loads, named by where it came from (`--port`, "
        "`NEURON_PORT`, `port in /etc/neuron/neuron.toml`).",
    ]
    for group in GROUPS:
        out += ["", f"## {title(group).capitalize()}", "", _first_line(group), ""]
        out += ["| flag | environment | TOML key | type | allowed | default | commands | what it does |"]
        out += ["|---|---|---|---|---|---|---|---|"]
        for f in dataclasses.fields(group):
            out.append(_setting_row(SETTINGS[f.name]))
    return "\n".join(out) + "\n"


def _setting_row(s: Setting) -> str:
    layered = "serve" in s.commands
    env = f"`{s.env}`" if layered else "-"
    key = f"`{s.name}`" if layered else "-"
    default = s.shown_default() + (f" ({s.spec.why})" if s.spec.why else "")
    return (
        f"| `{s.flag}` | {env} | {key} | {_TYPES[s.type]} | {_cell(s.bounds())} | {_cell(default)} "
        f"| {', '.join(s.commands)} | {_cell(s.help)} |"
    )


def architectures_page() -> str:
    return (
        "# Architectures\n\n"
        "What neuron serves of each model architecture (`model_type` in the model's `config.json`), from the table "
        "every check reads (`neuron/models/architectures.py`). Any other architecture is refused before a weight is "
        "read.\n\n" + architectures.markdown() + "\n"
    )


def metrics_page() -> str:
    out = [
        "# Metrics",
        "",
        "`GET /metrics` serves these in Prometheus' text format (the leader's; workers keep none). A counter's "
        "samples carry Prometheus' `_total` suffix, a histogram's `_bucket`, `_sum` and `_count`.",
        "",
        "| metric | type | labels | what it counts |",
        "|---|---|---|---|",
    ]
    for metric in metrics.REGISTRY.collect():
        labels = sorted({label for sample in metric.samples for label in sample.labels} - {"le"})
        out.append(_metric_row(metric, labels or _labels(metric.name)))
    router = RouterMetrics()
    out += [
        "",
        "A router of several models ([Several models](../several-models.md)) serves these, and beside them every "
        "loaded model's server's own, each sample with a `model` label:",
        "",
        "| metric | type | labels | what it counts |",
        "|---|---|---|---|",
    ]
    named = {m._name: list(m._labelnames) for m in (router.state, router.loads, router.swaps, router.in_flight)}
    out += [_metric_row(metric, named.get(metric.name, [])) for metric in router.registry.collect()]
    return "\n".join(out) + "\n"


def _metric_row(metric: Metric, labels: list[str]) -> str:
    name = f"{metric.name}_total" if metric.type == "counter" else metric.name
    return f"| `{name}` | {metric.type} | {', '.join(f'`{x}`' for x in labels)} | {_cell(metric.documentation)} |"


def _labels(name: str) -> list[str]:
    """A labelled metric's label names, which it only samples once a label has a value."""
    for value in vars(metrics).values():
        if getattr(value, "_name", None) == name:
            return list(value._labelnames)
    return []


def _fields(cls: type) -> str:
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    return ", ".join(f"`{name}`: {_cell(str(kind))}" for name, kind in hints.items() if name != "id") or "-"


def protocol_page() -> str:
    out = [
        "# Protocol messages",
        "",
        f"Version {rpc.PROTOCOL_VERSION}. The leader writes one JSON object per line to a worker's stdin; the worker "
        f"answers each with one line on its stdout, echoing the request's `id` (a line is at most "
        f"{rpc.MAX_LINE_BYTES >> 20} MiB). Any request may be answered with `error` instead of its reply.",
        "",
        "## Requests and their replies",
        "",
        "| op | fields | reply | reply's fields | what it does |",
        "|---|---|---|---|---|",
    ]
    for request, reply in rpc.EXPECTED_REPLY.items():
        out.append(
            f"| `{request.op}` | {_fields(request)} | `{reply.op}` | {_fields(reply)} | {_cell(_first_line(request))} |"
        )
    out += ["", "## Errors", "", f"`error` carries {_fields(rpc.Error)}; its `kind` is one of:", ""]
    out += [f"- `{kind.value}`" for kind in rpc.ErrorKind]
    nested = [rpc.StepPlan, rpc.Prefill, rpc.Decode, rpc.Restore, rpc.Save, rpc.Evict, rpc.HostInfo]
    out += ["", "## What a step carries", "", "| type | fields | what it is |", "|---|---|---|"]
    out += [f"| `{cls.__name__}` | {_fields(cls)} | {_cell(_first_line(cls))} |" for cls in nested]
    return "\n".join(out) + "\n"


def openapi() -> dict[str, Any]:
    """The document ``GET /openapi.json`` serves before a model is loaded: the one call into the HTTP layer."""
    from neuron.server.app import describe

    return describe("MODEL")


def routes_page() -> str:
    out = [
        "# HTTP routes",
        "",
        "What `neuron serve` answers, from the OpenAPI document it serves at `/openapi.json` (fetch that for every "
        "field's schema, with the loaded model's limits). Routes marked *key* need `Authorization: Bearer KEY` "
        "when `--api-key` is set.",
        "",
        "| method | path | key | what it does |",
        "|---|---|---|---|",
    ]
    for path, methods in openapi()["paths"].items():
        for method, operation in methods.items():
            keyed = "key" if operation.get("security") else ""
            out.append(f"| {method.upper()} | `{path}` | {keyed} | {_cell(operation.get('summary', ''))} |")
    return "\n".join(out) + "\n"


PAGES: dict[str, Callable[[], str]] = {
    "reference/settings.md": settings_page,
    "reference/architectures.md": architectures_page,
    "reference/metrics.md": metrics_page,
    "reference/protocol.md": protocol_page,
    "reference/routes.md": routes_page,
}


if __name__ == "__main__":
    print(PAGES[f"reference/{sys.argv[1]}.md"](), end="")
