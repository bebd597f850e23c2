"""The modules of neuron's that one steady decode step enters, read from a call trace (``testkit.trace``): the
walk ``docs/architecture.md`` tells, for ``bench/step_trace.py`` and the test that holds the document to it."""

from __future__ import annotations

from pathlib import Path

import httpx

from testkit.models import make_tiny_model
from testkit.server import Server
from testkit.trace import OUT_ENV, TURN_ENV

LEADER, STREAMS, WORKER = "leader", "streams", "worker"


def steady_step(tmp: Path, tp: int = 2, turn: int = 20) -> dict[str, list[tuple[str, int]]]:
    """Serve a tiny generated llama at ``tp`` ranks through ``testkit.trace``, decode one greedy stream, and return
    what the ``turn``-th step entered: on the leader (the engine's loop and rank 0's thread), on the leader's event
    loop meanwhile (the HTTP streams), and on a worker; each a list of modules, in the order first entered, with the
    times each was entered from another module."""
    model = make_tiny_model(tmp / "tiny", "llama")
    out = tmp / "trace"
    env = {TURN_ENV: str(turn), OUT_ENV: str(out)}
    server = Server("--model", str(model), "--tp", str(tp), log_path=tmp / "serve.log", module="testkit.trace", env=env)
    try:
        server.start()
        body = {"model": model.name, "prompt": "hello", "max_tokens": 3 * turn, "temperature": 0.0, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        leader = server.process.pid
    finally:
        server.stop()
    walks: dict[str, list[tuple[str, int]]] = {}
    for path in sorted(tmp.glob("trace.*")):
        who = {"": LEADER, ".streams": STREAMS}.get(path.name.removeprefix(f"trace.{leader}"), WORKER)
        walks[who] = [(module, int(n)) for module, n in (line.split() for line in path.read_text().splitlines())]
    return walks
