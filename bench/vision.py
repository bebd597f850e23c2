"""Time to first token for a chat with one 1024 x 1024 image, at TP=1 and TP=2, and the vision encoder's share.

Run: .venv/bin/python bench/vision.py [--rounds 3] [--hidden 512] [--layers 8] [--vision-hidden 256]

A generated Mistral 3 (random weights; mlx-vlm's Pixtral tower with patches of 16 pixels merged 2 by 2, so a
1024 x 1024 image is 1,024 image tokens plus 32 row breaks) served by ``neuron serve``, one server at a time. Each
round streams a greedy chat with a fresh picture (another seed: the prefix cache never hits), and, as the baseline
measured in the same run, a text-only chat of about as many prompt tokens. TTFT is from sending the request to the
first text event; medians over the rounds.

The encoder's share is timed in this process on the code the server runs for it: the leader's processor
(``engine.image_prompts.Vision.encode``: resize, normalize, expand the placeholder) and rank 0's encoder
(``rank.model.vision.Encoder``: the vision tower and projector), each on a fresh picture of the same size.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import time
from pathlib import Path

from streaming import events

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EDGE = 1024


def ttft(url: str, content: str | list[dict]) -> tuple[float, int]:
    """Seconds to the first text event, and the prompt's tokens."""
    body = {"model": "mistral3", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    started, first, prompt_tokens = time.perf_counter(), None, 0
    for event in events(url, "/v1/chat/completions", body):
        if event.get("usage"):
            prompt_tokens = event["usage"]["prompt_tokens"]
        if (event.get("choices") or [{}])[0].get("delta", {}).get("content") and first is None:
            first = time.perf_counter()
    return (first or time.perf_counter()) - started, prompt_tokens


def image_content(seed: int) -> list[dict]:
    from testkit.vision import png

    url = "data:image/jpeg;base64," + base64.b64encode(png(EDGE, EDGE, seed=seed, fmt="JPEG")).decode()
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe this picture."}]


def processing_seconds(model: Path, rounds: int) -> float:
    """Median seconds of the leader's processing of one fresh picture (resize, normalize, expand)."""
    from neuron import images
    from neuron.engine.image_prompts import Vision
    from testkit.vision import png

    vision = Vision.load(model)
    assert vision is not None
    out = []
    for seed in range(1000, 1000 + rounds + 1):
        picture = images.decode(png(EDGE, EDGE, seed=seed, fmt="JPEG"), "bench")
        started = time.perf_counter()
        vision.encode(f"[INST]{vision.placeholder}Describe this picture.[/INST]", [picture])
        out.append(time.perf_counter() - started)
    return statistics.median(out[1:])  # the first round fills the processor's caches: left out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vision-hidden", type=int, default=256)
    parser.add_argument("--vision-layers", type=int, default=4)
    args = parser.parse_args()

    from testkit import Server
    from testkit.vision import make_tiny_mistral3

    work = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    model = make_tiny_mistral3(
        work / "mistral3",
        longest_edge=EDGE,
        hidden=args.hidden,
        layers=args.layers,
        patch=16,
        vision_hidden=args.vision_hidden,
        vision_layers=args.vision_layers,
    )
    rows = []
    for tp in (1, 2):
        server = Server("--model", str(model), "--tp", str(tp), log_path=work / f"tp{tp}.log").start()
        try:
            ttft(server.url, image_content(seed=1))  # warm up: the first request compiles and fills caches
            with_image, tokens = [], 0
            text_only = []
            for r in range(args.rounds):
                seconds, tokens = ttft(server.url, image_content(seed=10 + r))
                with_image.append(seconds)
                # The baseline: a text prompt of about as many tokens (one character a token in this vocabulary).
                filler = "".join(chr(97 + (i * 7 + r) % 26) for i in range(tokens - 20))
                text_only.append(ttft(server.url, f"{filler} Describe this picture.")[0])
            # Rank 0's encoder as the server ran it (its "image encoded" log), the warm-up left out.
            encoded = [e["ms"] / 1e3 for e in server.logs() if e.get("event") == "image encoded"][1:]
        finally:
            server.stop()
        rows.append(
            (tp, tokens, statistics.median(with_image), statistics.median(text_only), statistics.median(encoded))
        )
    processing = processing_seconds(model, args.rounds)

    base = rows[0][2]
    print(
        f"model: hidden {args.hidden}, {args.layers} layers; vision hidden {args.vision_hidden}, "
        f"{args.vision_layers} layers; image {EDGE}x{EDGE}"
    )
    print(
        "| TP | prompt tokens | TTFT with image ms | vs TP=1 | rank 0's encoder ms | encoder's share "
        "| text-only TTFT, as many tokens ms | image / text |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for tp, tokens, image_s, text_s, encoder_s in rows:
        print(
            f"| {tp} | {tokens} | {image_s * 1e3:.0f} | {image_s / base:.2f}x | {encoder_s * 1e3:.0f} "
            f"| {encoder_s / image_s:.0%} | {text_s * 1e3:.0f} | {image_s / text_s:.2f}x |"
        )
    print(f"leader's processing (this process): {processing * 1e3:.0f} ms, {processing / base:.0%} of TTFT at TP=1")


if __name__ == "__main__":
    main()
