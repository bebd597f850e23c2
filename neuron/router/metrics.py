"""``/metrics`` of a router: its own counts per model, and each loaded model's server's metrics with a ``model``
label added, so that one scrape sees every model (as a single server's scrape sees its one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from neuron.router.child import Child

STATES = ("unloaded", "loading", "loaded", "unloading", "failed")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.state = Gauge(
            "neuron_model_state", "1 for each model's present state", ["model", "state"], registry=self.registry
        )
        self.loads = Counter("neuron_model_loads", "model loads that served", ["model"], registry=self.registry)
        self.swaps = Counter("neuron_model_swaps", "models unloaded to make room for another", registry=self.registry)
        self.in_flight = Gauge(
            "neuron_model_requests_in_flight", "requests forwarded to a model and not yet answered", ["model"],
            registry=self.registry,
        )  # fmt: skip
        self._counted: dict[str, int] = {}
        self._swaps = 0

    def render(self, children: list[Child], swaps: int, servers: dict[str, str]) -> bytes:
        """The router's counts brought up to date, then each server's exposition (``servers``: model -> text)
        with its model's label."""
        for child in children:
            name = child.model.name
            for state in STATES:
                self.state.labels(name, state).set(1 if child.state == state else 0)
            self.loads.labels(name).inc(child.loads - self._counted.get(name, 0))
            self._counted[name] = child.loads
            self.in_flight.labels(name).set(child.in_flight)
        self.swaps.inc(swaps - self._swaps)
        self._swaps = swaps
        return generate_latest(self.registry) + merged(servers)


def merged(servers: dict[str, str]) -> bytes:
    """The servers' expositions (model -> text) as one, ``model="..."`` on every sample, each family once."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for model, text in servers.items():
        for family in text_string_to_metric_families(text):
            name = family.name + ("_total" if family.type == "counter" else "")
            kind = "untyped" if family.type == "unknown" else family.type
            _, _, samples = families.setdefault(name, (kind, family.documentation, []))
            for sample in family.samples:
                labels = {**sample.labels, "model": model}
                rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
                samples.append(f"{sample.name}{{{rendered}}} {sample.value!r}")
    lines = []
    for name, (kind, documentation, samples) in families.items():
        lines += [f"# HELP {name} {_escape(documentation)}", f"# TYPE {name} {kind}", *samples]
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
