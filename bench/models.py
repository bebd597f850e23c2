"""Several models in one server (issue 63): time to first token for a model that is not loaded (its load included)
and for one that is, and the swap at ``--models-max 1``, against a single ``neuron serve``'s own start.

Run: .venv/bin/python bench/models.py [--rounds 5] [--model FOLDER]

One router serving the same model under two names (``a`` and ``b``, two ``[[models]]`` tables, TP=1), at
``--models-max 1``. Per round: ``a`` unloaded (``/models/unload``) and asked (cold: its server starts, loads and
answers), asked again (warm), then ``b`` asked (a swap: ``a`` unloads, ``b`` loads and answers). The baseline, in
the same run: a plain ``neuron serve`` of the model, from its start to its first answer. The model is the embedded
SmolLM2-135M unless ``--model`` names a folder.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit import Server, sse_events  # noqa: E402


def first_token_s(url: str, model: str) -> float:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0, "stream": True}
    sent = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        for event in sse_events(reply):
            if isinstance(event, dict) and event.get("choices") and event["choices"][0]["text"]:
                return time.perf_counter() - sent
    raise RuntimeError(f"no text from {model}")


def plain_start_s(model: Path, scratch: Path, round_: int) -> float:
    """A single server's start to its first answer: what a cold model in a router compares with."""
    started = time.perf_counter()
    server = Server("--model", str(model), log_path=scratch / f"plain{round_}.log")
    try:
        server.start()
        first_token_s(server.url, model.name if model.is_dir() else model.stem)
        return time.perf_counter() - started
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", type=Path)
    args = parser.parse_args()
    if args.model is None:
        from neuron.models.folder import resolve

        args.model = resolve(None)
    scratch = Path(tempfile.mkdtemp())
    config = scratch / "neuron.toml"
    config.write_text(
        "models_max = 1\n"
        f"[[models]]\nname = 'a'\nmodel = '{args.model}'\n"
        f"[[models]]\nname = 'b'\nmodel = '{args.model}'\n"
    )
    router = Server("--config", str(config), log_path=scratch / "router.log")
    cold: list[float] = []
    warm: list[float] = []
    swap: list[float] = []
    plain: list[float] = []
    try:
        router.start()
        first_token_s(router.url, "a")  # the page cache warmed for both servers
        for i in range(args.rounds):
            plain.append(plain_start_s(args.model, scratch, i))
            httpx.post(f"{router.url}/models/unload", json={"model": "a"}, timeout=600).raise_for_status()
            httpx.post(f"{router.url}/models/unload", json={"model": "b"}, timeout=600).raise_for_status()
            cold.append(first_token_s(router.url, "a"))
            warm.append(statistics.median(first_token_s(router.url, "a") for _ in range(3)))
            swap.append(first_token_s(router.url, "b"))
    finally:
        router.stop()
    print(f"model {args.model.name}, {args.rounds} rounds (medians; range)")

    def line(what: str, times: list[float]) -> None:
        print(f"  {what}: {statistics.median(times):.3f} s ({min(times):.3f}-{max(times):.3f})", end="")
        print(f" = {statistics.median(times) / statistics.median(plain):.2f}x a plain server's start to first token")

    line("plain neuron serve, start to first token", plain)
    line("cold model, time to first token (load included)", cold)
    line("swap at --models-max 1, time to first token", swap)
    print(f"  warm model, time to first token: {statistics.median(warm) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
