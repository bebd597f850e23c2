"""Speculative decoding (prompt lookup, ``prediction``) on and off: decode speed and acceptance, in one run.

Run: .venv/bin/python bench/speculate.py [--model FOLDER] [--tp 1 3] [--max-tokens 128] [--sizes 1 8] [--tasks ...]
     [--rounds 3]
     .venv/bin/python bench/speculate.py --widened [--tp 1 2]
     .venv/bin/python bench/speculate.py --generated [--hidden 2048 --layers 8 --heads 32 ...] [--tp 1 2]

(SmolLM2-135M has 9 attention heads: TP=3, not 2, splits it. ``--widened`` serves SmolLM2 widened to 12 and 6 heads,
the same function (bench/widened.py), which splits over 2: its text and acceptance are SmolLM2's. ``--generated``
serves a random-weight qwen3 of the given shape instead (bench/generated.py): its text is noise, so its acceptance
only says how often it repeats itself, but its step times are a larger model's, where the batch's cost rule matters
most.)

One ``neuron serve`` per TP size (speculation on, the default); every request
is sent twice, with ``num_draft_tokens: 0`` (no drafts) and without, so both
run on the same server. Tasks, greedy chat:

- edit: rewrite a given code snippet with one name changed (prompt lookup finds the snippet);
- edit + prediction: the same, the original snippet sent as OpenAI's ``prediction``;
- quote: summarise a passage quoting its sentences (prompt lookup);
- chat: free chat, nothing to look up (adaptive k must keep it from slowing down);
- mixed (batch sizes above 1): the four above side by side (at batch 8, two of each): rows that accept different
  counts, as a server's batch does (the identical rows of the other tasks accept alike, and rarely pay for
  realigning their caches).

Batch 1: one request at a time; batch 8: eight at once. Tokens per second are
completion tokens over the wall time of the batch; each prompt is sent once
before (one token), so that on and off both find it in the prefix cache and
the ratio is decode's. Each row is ``--rounds`` off/on pairs, alternating (runs of one row differ by up to 40% on a
shared machine): the medians of off, of on and of the pairs' ratios, and the ratios' spread. Acceptance is accepted
/ proposed draft tokens (the last round's). After each TP size, the step-time model the server fitted
(``fixed_ms + row_ms x rows``, the batch's cost rule weighs drafts with it) from its step log.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

if TYPE_CHECKING:
    from testkit import Server

SNIPPET = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        if item.quantity <= 0:
            continue
        total += item.price * item.quantity
    total = total * (1 + tax_rate)
    return round(total, 2)


def average_price(items):
    if not items:
        return 0
    total = 0
    for item in items:
        total += item.price
    return total / len(items)
"""
PASSAGE = (
    "The committee met on Tuesday. It approved the new budget for the library. It asked the city to repair "
    "the roof before winter. It thanked the volunteers who ran the book fair. It will meet again in March."
)
TASKS = {
    "edit": (
        "Rewrite this code, renaming the variable `total` to `acc`. Reply with the code only.\n\n" + SNIPPET,
        None,
    ),
    "edit + prediction": (
        "Rewrite this code, renaming the variable `total` to `acc`. Reply with the code only.\n\n" + SNIPPET,
        SNIPPET,
    ),
    "quote": ("Summarise this passage, quoting each sentence exactly:\n\n" + PASSAGE, None),
    "chat": ("Tell me a short story about a lighthouse keeper and a storm.", None),
}
MIXED = "mixed"


def one(url: str, model: str, task: str, drafts: bool, max_tokens: int) -> dict:
    prompt, prediction = TASKS[task]
    body: dict = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    if not drafts:
        body["num_draft_tokens"] = 0
    if prediction and drafts:
        body["prediction"] = {"type": "content", "content": prediction}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


def batch(url: str, model: str, task: str, drafts: bool, size: int, max_tokens: int) -> tuple[float, float, list[str]]:
    """Tokens per second, acceptance, and the replies' texts. ``mixed``: request i runs task i of the others, in
    turn, so the rows of a batch accept different counts, as a server's do."""
    tasks = [list(TASKS)[i % len(TASKS)] if task == MIXED else task for i in range(size)]
    started = time.perf_counter()
    with ThreadPoolExecutor(size) as pool:
        replies = list(pool.map(lambda t: one(url, model, t, drafts, max_tokens), tasks))
    seconds = time.perf_counter() - started
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    details = [r["usage"].get("completion_tokens_details") or {} for r in replies]
    kept = sum(d.get("accepted_prediction_tokens", 0) for d in details)
    proposed = kept + sum(d.get("rejected_prediction_tokens", 0) for d in details)
    return (
        tokens / seconds,
        kept / proposed if proposed else 0.0,
        [r["choices"][0]["message"]["content"] for r in replies],
    )


def fitted_cost(server: Server) -> str:
    """The last step-time model the server logged (its ``step`` trace), or why there is none."""
    steps = [e for e in server.logs() if e.get("event") == "step" and "row_ms" in e]
    if not steps:
        return "no step trace in the log (run with --log-level trace)"
    return f"{steps[-1]['fixed_ms']:.1f} ms + {steps[-1]['row_ms']:.2f} ms x rows"


def main() -> None:
    from generated import add_shape_flags, generated_model

    from testkit import Server

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="model folder (default: the embedded SmolLM2)")
    parser.add_argument("--widened", action="store_true", help="SmolLM2 widened to split over 2 ranks instead")
    parser.add_argument("--generated", action="store_true", help="a generated qwen3 of the shape below instead")
    add_shape_flags(parser)
    parser.add_argument("--tp", type=int, nargs="+", help="TP sizes (default: 1 3; 1 2 with --widened, --generated)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8], help="batch sizes")
    parser.add_argument("--tasks", nargs="+", default=[*TASKS, MIXED], choices=[*TASKS, MIXED])
    parser.add_argument("--rounds", type=int, default=3, help="off/on pairs per row (medians reported)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="neuron-bench-speculate-"))
    if args.generated:
        args.model = str(generated_model(args, scratch / "qwen3"))
    if args.widened:
        from widened import widened_smollm2

        from neuron.models.folder import resolve

        args.model = str(widened_smollm2(resolve(args.model), scratch / "smollm2-widened"))
    tps = args.tp or ([1, 2] if args.generated or args.widened else [1, 3])

    from neuron.models.folder import model_id

    model = model_id(args.model)
    print("| TP | batch | task | tok/s off | tok/s on | speedup | spread | acceptance | same text |")
    print("|---|---|---|---|---|---|---|---|---|")
    costs = []
    for tp in tps:
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"neuron-bench-speculate-{os.getpid()}.log"
        server = Server(
            *(["--model", args.model] if args.model else []), "--tp", str(tp), "--log-level", "trace", log_path=log
        )
        try:
            server.start()
            one(server.url, model, "chat", True, 4)  # warm up
            for size in args.sizes:
                for task in args.tasks:
                    if task == MIXED and size == 1:  # one request at a time: the tasks' own rows
                        continue
                    # The prompt into the prefix cache first: else the first run of each prompt (drafts off) pays
                    # its prefill and the second does not, and the speedup reads higher than decode's.
                    for name in TASKS if task == MIXED else [task]:
                        one(server.url, model, name, False, 1)
                    # Off and on alternate, so that a slow spell of this shared machine lands on both.
                    offs, ons, ratios, same = [], [], [], True
                    for _ in range(args.rounds):
                        off, _, text_off = batch(server.url, model, task, False, size, args.max_tokens)
                        on, acceptance, text_on = batch(server.url, model, task, True, size, args.max_tokens)
                        offs.append(off)
                        ons.append(on)
                        ratios.append(on / off)
                        same = same and text_on == text_off
                    spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if args.rounds > 1 else "-"
                    speeds = f"{median(offs):.1f} | {median(ons):.1f} | {median(ratios):.2f}x"
                    row = f"{speeds} | {spread} | {acceptance:.0%}"
                    print(f"| {tp} | {size} | {task} | {row} | {'yes' if same else 'NO'} |")
                    sys.stdout.flush()
            costs.append(f"TP={tp}: {fitted_cost(server)}")
        finally:
            server.stop()
            log.unlink(missing_ok=True)
    print("\nstep-time model fitted:", "; ".join(costs))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
