"""Agent sessions against ``neuron serve``: the share of reusable prompt tokens served from the prefix cache, the
time to first token per turn and the throughput, with the cache off, in memory, and restored from disk after a
restart, in one run.

Run: .venv/bin/python bench/agents.py [--turns 20] [--sessions 4] [--model FOLDER]

Each case starts a fresh server and replays ``--sessions`` agent sessions at once (testkit.agents: a system prompt,
tools, forced tool calls and their results, short replies; half in OpenAI's Chat form, half in Anthropic's Messages
form), each ``--turns`` turns long, every request streamed. Reusable: the longest beginning a turn's prompt shares
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
            done = list(pool.map(lambda api: replay(server.url, Session(api, model.name, stream=True), turns), apis))
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
    print(
        "| case | reusable share cached (turns 2+) | prompt share cached | TTFT median s (turn 1, turns 2+) "
        "| TTFT p90 s (turns 2+) | prompt tokens per s | turns per minute | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (sessions, seconds) in results.items():
        turns = [t for s in sessions for t in s.turns]
        later = [t.first for s in sessions for t in s.turns[1:]]
        first = statistics.median(s.turns[0].first for s in sessions)
        prompt = sum(t.prompt_tokens for t in turns)
        cached = sum(t.cached_tokens for t in turns) / prompt
        p90 = statistics.quantiles(later, n=10)[-1] if len(later) > 1 else later[0]
        print(
            f"| {name} | {share(sessions):.3f} | {cached:.3f} | {first:.2f}, {statistics.median(later):.2f} "
            f"| {p90:.2f} | {prompt / seconds:.0f} | {60 * len(turns) / seconds:.1f} | {seconds:.0f} |"
        )
    off = results["cache off"][1]
    for name in ("cache in memory", "restored from disk"):
        print(f"wall time, {name} / cache off: {results[name][1] / off:.2f}")
    print("\nTime to first token by turn (median over the sessions, s) and prompt tokens (median)\n")
    print("| turn | prompt tokens | " + " | ".join(results) + " |")
    print("|---|---|" + "---|" * len(results))
    for i in range(args.turns):
        prompt_i = statistics.median(s.turns[i].prompt_tokens for s in results["cache off"][0])
        cells = [f"{statistics.median(s.turns[i].first for s in done):.2f}" for done, _ in results.values()]
        print(f"| {i + 1} | {prompt_i:.0f} | " + " | ".join(cells) + " |")
    for api in ("openai", "anthropic"):
        of = {name: [s for s in done if s.api == api] for name, (done, _) in results.items()}
        print(f"reusable share cached, {api} form: " + ", ".join(f"{n} {share(v):.3f}" for n, v in of.items()))
    print("(the share counts turns 2+, as the tests do; the disk case's first turns hit too)")


if __name__ == "__main__":
    main()
