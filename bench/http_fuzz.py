"""Schemathesis against the served OpenAPI schema, the long run of tests/e2e/faults/test_hostile_http.py.

Run: .venv/bin/python bench/http_fuzz.py [--examples 200] [--seed 1]

Starts a keyed TP=1 server on the tiny model (context 128), every phase, runs every
schemathesis check (ours standing in for positive_data_acceptance), and prints
schemathesis's summary plus what the server saw: requests served, refused, and
errors logged.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    from testkit import Server, make_tiny_model
    from testkit.fuzzing import KEY, run_schemathesis  # the fuzzing run itself is the hostile-HTTP test's

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "qwen3", "qwen3")
        server = Server("--model", str(model), "--max-context", "128", api_key=KEY, log_path=Path(tmp) / "log")
        try:
            result = run_schemathesis(server.start().url, args.examples, args.seed, "coverage,fuzzing,stateful")
            events = Counter(e.get("event") for e in server.logs())
            errors = sum(e.get("level") == "error" for e in server.logs())
        finally:
            server.stop()
    summary = result.stdout[result.stdout.find("SUMMARY") :] if "SUMMARY" in result.stdout else result.stdout[-3000:]
    print(summary)
    print("| schemathesis exit | requests served | requests refused (4xx) | errors logged |")
    print("|---|---|---|---|")
    print(f"| {result.returncode} | {events['request done']} | {events['request refused']} | {errors} |")


if __name__ == "__main__":
    main()
