"""Schemathesis run against a server's own OpenAPI schema, with testkit/schemathesis_hooks.py's check standing in
for its ``positive_data_acceptance``: the hostile-HTTP test's fuzzing (tests/e2e/faults/test_hostile_http.py), which
bench/http_fuzz.py runs longer."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from testkit.server import ROOT

KEY = "secret"  # the fuzzed server's API key
SCHEMATHESIS = Path(sys.executable).parent / "st"

# The operations in two halves of about equal work, fuzzed by two schemathesis processes at once: one generates (most
# of a run) while the server answers the other. The first half holds the routes that reach the model, the second
# the larger schemas, whose cases are more but cheaper. Not two workers in one process: on Python 3.11 hypothesis's
# ``ast.parse`` in two threads at once trips "AST constructor recursion depth mismatch" (python/cpython#106905).
# Both halves hold ``GET /v1/models``, whose answers the others draw model names from; every other operation is in
# exactly one.
HALF = "^/(v1/(completions|embeddings|responses)|(de)?tokenize)$"
MODELS = "^/v1/models$"


def run_schemathesis(
    url: str, examples: int, seed: int, phases: str = "coverage,fuzzing"
) -> subprocess.CompletedProcess[str]:
    """Every schemathesis check, with ours standing in for ``positive_data_acceptance`` (testkit.schemathesis_hooks),
    on every operation (in two halves at once); the exit status is the worse half's, the output both halves'."""
    command = [str(SCHEMATHESIS), "run", f"{url}/openapi.json", "--header", f"Authorization: Bearer {KEY}"]
    command += ["--checks", "all", "--exclude-checks", "positive_data_acceptance"]
    command += ["--phases", phases, "--max-examples", str(examples), "--seed", str(seed), "--workers", "1"]
    # A case may be heavy (a thousand inputs to embed), and a loaded machine slow: past schemathesis's default of
    # 10 s, but an answer all the same. What hangs still fails, at a minute.
    command += ["--output-truncate", "true", "--request-timeout", "60", "--max-response-time", "60"]
    # The hooks are a module schemathesis imports by name, from the repository's root.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "testkit.schemathesis_hooks", "PYTHONPATH": path}
    halves = [
        [*command, "--include-path-regex", f"{HALF}|{MODELS}"],
        [*command, "--exclude-path-regex", HALF],
    ]
    # Each half's output to a file of its own: a pipe left unread while the other half is waited for would stall it.
    with tempfile.TemporaryFile("w+") as first, tempfile.TemporaryFile("w+") as second:
        running = [
            subprocess.Popen(half, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
            for half, out in zip(halves, (first, second), strict=True)
        ]
        try:
            codes = [process.wait(timeout=900) for process in running]
        finally:
            for process in running:
                process.kill()
        output = ""
        for out in (first, second):
            out.seek(0)
            output += out.read()
    return subprocess.CompletedProcess(halves[0], max(codes, key=abs), output, "")
