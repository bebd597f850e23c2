"""Speculative decoding with a draft model (``--draft-model``): decode speed with the draft against without it, in
one run, on one server per case (each request sent with ``num_draft_tokens: 0`` and without, alternating).

Run: .venv/bin/python bench/draft.py [--cases exact random mtp smollm2] [--tp 1 2] [--sizes 1 4] [--max-tokens 96]
     [--rounds 3] [--smol-layers 6 24] [--hidden 1024 --layers 8 --heads 16 --intermediate 2816]
     [--mtp-archs glm4_moe qwen3_next] [--mtp-damping 0.0 0.05]

No real small/large pair installs here, so the pairs are built:

- exact: a generated qwen3 (the shape flags; bench/generated.py) whose layers after the first add nothing (their
  output projections zeroed: testkit.quiet_layers), and a draft cut to its first layer (testkit.cut_layers): the
  draft computes what the target computes, every draft is kept, and a draft step costs about one layer of the
  target's. The mechanism's best case, at each ``--tp``.
- random: the same target, and a random one-layer qwen3 of the same width as the draft: next to nothing is kept,
  so this is what a useless draft costs (adaptive k must keep it small). TP=1.
- mtp: a generated GLM-4.5-shaped MoE (glm4_moe, the shape flags) whose layers all add nothing, and a prediction
  layer of its own that computes what it computes (testkit.add_prediction_layer), served with --speculate mtp: every
  draft is kept, and a draft token costs one MoE layer of the model's, its head and the draft's fixed cost. The same
  for a generated Qwen3-Next (qwen3_next: three gated delta layers in four, whose states a rejected draft takes
  back, rank.states). With a ``--mtp-damping`` above 0 the layers add that much of their output: the layer agrees
  often, not always, and rejected drafts are dropped (the linear-attention states' cost shows there).
- smollm2: the embedded SmolLM2-135M-Instruct, and drafts cut from its own first ``--smol-layers`` layers (no
  training: their last hidden state goes straight to the head), greedy chat on real prompts. TP=1 (9 heads).

Greedy; tokens per second are completion tokens over the batch's wall time (batch: that many requests at once),
each prompt sent once before so that both find it in the prefix cache, and one batch of each kind run first,
unmeasured, so that the server's step-time model has timed its steps. Medians over ``--rounds`` off/on pairs, and
the spread of the pairs' ratios. Acceptance: draft tokens kept over draft tokens verified; verified/token: draft
tokens verified per token asked for (the extra rows the target computed: what a draft costs, free of the load's
noise). CPU per token, on/off: the server's processes' CPU time per token with the draft over without it (median
over the rounds, and the range): what the draft costs the machine, which other processes' load leaves alone (the
wall time they stretch).
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

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

CHATS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works, step by step.",
    "List five tips for staying productive when working from home.",
    "Describe the water cycle to a ten-year-old.",
]


def one(url: str, model: str, i: int, drafts: bool, max_tokens: int, chat: bool) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0.0}
    if chat:
        body["messages"] = [{"role": "user", "content": CHATS[i % len(CHATS)]}]
    else:
        body["prompt"] = f"request {i}: hello world, "
    if not drafts:
        body["num_draft_tokens"] = 0
    response = httpx.post(f"{url}/v1/{'chat/completions' if chat else 'completions'}", json=body, timeout=900)
    response.raise_for_status()
    return response.json()


def text_of(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system) the server's processes have used so far: ``pid`` and every descendant alive."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        no = int(stat.parent.name)
        parents[no] = int(fields[1])
        times[no] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        no = todo.pop()
        total += times.get(no, 0.0)
        todo += [child for child, parent in parents.items() if parent == no]
    return total


def batch(
    url: str, model: str, size: int, drafts: bool, max_tokens: int, chat: bool, pid: int = 0
) -> tuple[float, int, int, list, float]:
    """Tokens per second, draft tokens kept and verified, the replies' texts, and the server's CPU milliseconds
    per token (where ``pid`` is given): what the machine's load leaves alone, unlike the wall time."""
    started, cpu = time.perf_counter(), cpu_seconds(pid) if pid else 0.0
    with ThreadPoolExecutor(size) as pool:
        replies = list(pool.map(lambda i: one(url, model, i, drafts, max_tokens, chat), range(size)))
    seconds = time.perf_counter() - started
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    cpu_ms = (cpu_seconds(pid) - cpu) * 1000 / tokens if pid else 0.0
    details = [r["usage"].get("completion_tokens_details") or {} for r in replies]
    kept = sum(d.get("accepted_prediction_tokens", 0) for d in details)
    verified = kept + sum(d.get("rejected_prediction_tokens", 0) for d in details)
    return tokens / seconds, kept, verified, [text_of(r) for r in replies], cpu_ms


def measure(case: str, target: Path, draft: Path | None, tp: int, args: argparse.Namespace, chat: bool) -> None:
    """One case's rows; ``draft`` None: the model's own prediction layer drafts (``--speculate mtp``)."""
    from neuron.models.folder import model_id
    from testkit import Server

    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"neuron-bench-draft-{os.getpid()}.log"
    drafting = ("--speculate", "mtp") if draft is None else ("--draft-model", str(draft))
    server = Server("--model", str(target), *drafting, "--tp", str(tp), log_path=log)
    model = model_id(str(target))
    try:
        server.start()
        # Warm: the step-time model that prices a draft's width (engine.drafts.StepCost) starts from a prior and
        # learns this server's costs from the steps it times, as a serving server has long before any one request.
        for drafts in (False, True):
            batch(server.url, model, max(args.sizes), drafts, args.max_tokens, chat)
        for size in args.sizes:
            for i in range(size):  # every prompt into the prefix cache first, so that both runs skip its prefill
                one(server.url, model, i, False, 1, chat)
            offs, ons, ratios, kept, verified, tokens, same = [], [], [], 0, 0, 0, True
            cpu_ratios = []
            pid = server.process.pid
            for _ in range(args.rounds):  # off and on alternate, so that a slow spell lands on both
                off, _, _, text_off, cpu_off = batch(server.url, model, size, False, args.max_tokens, chat, pid)
                on, k, v, text_on, cpu_on = batch(server.url, model, size, True, args.max_tokens, chat, pid)
                offs.append(off)
                ons.append(on)
                ratios.append(on / off)
                cpu_ratios.append(cpu_on / cpu_off)
                kept, verified, tokens = kept + k, verified + v, tokens + size * args.max_tokens
                same = same and text_on == text_off
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if args.rounds > 1 else "-"
            acceptance = f"{kept / verified:.0%}" if verified else "none verified"
            # Draft tokens verified per token asked for: the extra rows the draft made the target compute, whatever
            # the machine's load did to the timings.
            row = f"{median(offs):.1f} | {median(ons):.1f} | {median(ratios):.2f}x | {spread} | {acceptance}"
            row += (
                f" | {verified / tokens:.2f} | {median(cpu_ratios):.2f}x ({min(cpu_ratios):.2f}-{max(cpu_ratios):.2f})"
            )
            print(f"| {case} | {tp} | {size} | {row} | {'yes' if same else 'NO'} |")
            sys.stdout.flush()
    finally:
        server.stop()
        log.unlink(missing_ok=True)


def shape_of(args: argparse.Namespace) -> dict:
    return {"hidden": args.hidden, "layers": args.layers, "heads": args.heads}


def _glm_fields(args: argparse.Namespace) -> dict:
    from testkit import GLM4_MOE

    return {
        **GLM4_MOE,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": args.intermediate // 4,
        "norm_topk_prob": True,
    }


def _next_fields(args: argparse.Namespace) -> dict:
    from testkit import QWEN3_NEXT

    linear = {"linear_num_value_heads": args.heads, "linear_num_key_heads": args.heads // 2}
    linear |= {"linear_key_head_dim": 64, "linear_value_head_dim": 64}
    moe = {"moe_intermediate_size": args.intermediate // 4, "shared_expert_intermediate_size": args.intermediate // 4}
    return {**QWEN3_NEXT, **linear, **moe}


MTP_FIELDS = {"glm4_moe": _glm_fields, "qwen3_next": _next_fields}  # each generated model's own config fields


def main() -> None:
    from generated import add_shape_flags, generated_model

    from neuron.models.folder import resolve
    from testkit import add_prediction_layer, cut_layers, make_tiny_model, quiet_layers

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=["exact", "random", "smollm2"])
    add_shape_flags(parser)
    parser.set_defaults(hidden=1024, layers=8, heads=16, intermediate=2816)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes of the exact and mtp cases")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4], help="batch sizes")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mtp-archs", nargs="+", default=["glm4_moe", "qwen3_next"], choices=sorted(MTP_FIELDS))
    parser.add_argument(
        "--mtp-damping", type=float, nargs="+", default=[0.0], help="what the mtp case's layers add (0: nothing)"
    )
    parser.add_argument(
        "--smol-layers", type=int, nargs="+", default=[6, 24], help="SmolLM2's first layers a draft keeps"
    )
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="neuron-bench-draft-"))
    try:
        print(
            "| case | TP | batch | tok/s off | tok/s on | speedup | spread | acceptance | verified/token "
            "| CPU per token, on/off | same text |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        if {"exact", "random"} & set(args.cases):
            target = quiet_layers(generated_model(args, scratch / "target"), 1, 0.0)
            exact = cut_layers(target, scratch / "exact-draft", 1)
            for tp in args.tp if "exact" in args.cases else []:
                measure("exact", target, exact, tp, args, chat=False)
            if "random" in args.cases:
                shape = {"hidden": args.hidden, "heads": args.heads, "intermediate": args.intermediate}
                random = make_tiny_model(scratch / "random-draft", "qwen3", seed=1, layers=1, **shape)
                measure("random", target, random, 1, args, chat=False)
        if "mtp" in args.cases:  # an MoE whose layers add nothing (or little), and an exact prediction layer
            for arch in args.mtp_archs:
                for damping in args.mtp_damping:
                    folder = scratch / f"{arch}-{damping}"
                    model = make_tiny_model(
                        folder, arch, intermediate=args.intermediate, extra=MTP_FIELDS[arch](args), **shape_of(args)
                    )
                    model = add_prediction_layer(quiet_layers(model, 0, damping), exact=True)
                    for tp in args.tp:
                        measure(f"mtp, {arch}, layers x{damping:g}", model, None, tp, args, chat=False)
        if "smollm2" in args.cases:
            smol = resolve(None)
            for layers in args.smol_layers:
                draft = cut_layers(smol, scratch / f"smol-draft-{layers}", layers)
                measure(f"smollm2, {layers} of 30 layers", smol, draft, 1, args, chat=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
