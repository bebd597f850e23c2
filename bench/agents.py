"""Agent sessions against ``neuron serve``: the share of reusable prompt tokens served from the prefix cache, the
time per turn and the throughput, with the cache off, in memory, and restored from disk after a restart, in one run.

Run: .venv/bin/python bench/agents.py [--turns 20] [--sessions 4] [--model FOLDER]

Each case starts a fresh server and replays ``--sessions`` agent sessions at once (testkit.agents: a system
prompt, tools, forced tool calls and their results, short replies; half in OpenAI's Chat form, half in
Anthropic's Messages form), each ``--turns`` turns long. Reusable: the longest beginning a turn's prompt shares
with a sequence the server computed for that session before (an earlier prompt followed by what it generated).
The model is the tests' tiny agent model unless ``--model`` names a folder made with ``make_agent_model``.
"Restored from disk": a server with ``--prefix-cache-dir`` replays the sessions and stops (writing its entries),
then a fresh one on the same folder replays them again (greedy: the same turns), and that replay is measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit import Server  # noqa: E402
from testkit.agents import Session, make_agent_model, replay, share  # noqa: E402

CASES = {
    "cache off": ["--prefix-cache-bytes", "0"],
    "cache in memory": [],
    "restored from disk": ["--prefix-cache-dir"],
}


def run_case(model: Path, extra: list[str], sessions: int, turns: int) -> tuple[list[Session], float]:
    """The sessions replayed at once on a fresh server; and the seconds they took together."""
    log = Path(tempfile.gettempdir()) / f"neuron-bench-agents-{os.getpid()}.log"
    server = Server("--model", str(model), *extra, log_path=log)
    try:
        server.start()
        started = time.perf_counter()
        apis = ["openai" if i % 2 == 0 else "anthropic" for i in range(sessions)]
        with ThreadPoolExecutor(sessions) as pool:
            done = list(pool.map(lambda api: replay(server.url, Session(api, model.name), turns), apis))
        return done, time.perf_counter() - started
    finally:
        server.stop()
        log.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--model", type=Path, help="a folder made with testkit.agents.make_agent_model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or make_agent_model(Path(folder) / "agent")
        results = {}
        for name, extra in CASES.items():
            if extra == ["--prefix-cache-dir"]:
                extra = [*extra, str(Path(folder) / "kv")]
                run_case(model, extra, args.sessions, args.turns)  # fills the folder, then stops
            results[name] = run_case(model, extra, args.sessions, args.turns)
    print(f"{args.sessions} agent sessions at once, {args.turns} turns each, model {model.name}, one run\n")
    print("| case | reusable share cached (turns 2+) | median s per turn (turn 1, 2+) | prompt tokens served per s |")
    print("|---|---|---|---|")
    for name, (sessions, seconds) in results.items():
        first = statistics.median(s.turns[0].seconds for s in sessions)
        later = statistics.median(t.seconds for s in sessions for t in s.turns[1:])
        prompt = sum(t.prompt_tokens for s in sessions for t in s.turns)
        print(f"| {name} | {share(sessions):.3f} | {first:.2f}, {later:.2f} | {prompt / seconds:.0f} |")
    off = results["cache off"][1]
    for name in ("cache in memory", "restored from disk"):
        print(f"wall time, {name} / cache off: {results[name][1] / off:.2f}")
    print("(the share counts turns 2+, as the tests do; the disk case's first turns hit too)")


if __name__ == "__main__":
    main()
