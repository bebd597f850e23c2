"""Images into Gemma 3 and Gemma 4: a tiny random model of each (mlx-vlm's vision tower, projector and language
model, with sliding-window layers that a chat with an image passes; Gemma 4's with per-layer inputs and a layer
reading another's keys and values) served by neuron at TP=1, TP=2 and PP=2 gives mlx-vlm's own greedy tokens for the
same images and prompt, a text-only chat too.

Where the features go differs: Gemma 3's are scaled down by the square root of the hidden size as they go in, and
the language model scales every input embedding up by it; Gemma 4's go in after the text's embeddings were scaled,
and its per-layer inputs read token 0 at an image's positions. neuron follows mlx-vlm in each."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.server import Server, serving
from testkit.vision import Once, as_mlx_vlm, make_tiny_gemma3, make_tiny_gemma4, mlx_vlm_tokens, png, solo_and_together

PROMPT = "Describe this."
PICTURES = [png(64, 48, seed=1), png(48, 64, seed=2), png(32, 32, seed=3)]


def parts(*pictures: bytes, text: str = PROMPT) -> list[dict]:
    urls = ["data:image/png;base64," + base64.b64encode(p).decode() for p in pictures]
    return [*({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": text}]


# One image; then a conversation with an image in an earlier turn and two in the last.
CHATS = {
    "image": ([{"role": "user", "content": parts(PICTURES[0])}], PICTURES[:1]),
    "text": ([{"role": "user", "content": PROMPT}], []),
    "turns": (
        [
            {"role": "user", "content": parts(PICTURES[0], text="What is this?")},
            {"role": "assistant", "content": "A square."},
            {"role": "user", "content": parts(PICTURES[1], PICTURES[2], text="And these two?")},
        ],
        PICTURES,
    ),
}


MAKERS = {"gemma3": make_tiny_gemma3, "gemma4": make_tiny_gemma4}


@pytest.fixture(scope="module", params=list(MAKERS))
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, once: Once) -> Path:
    arch = request.param
    return once(arch, lambda: MAKERS[arch](tmp_path_factory.mktemp("vlm") / arch))


@pytest.fixture(scope="module")
def expected(vlm: Path, once: Once) -> dict[str, list[str]]:
    return once(("expected", vlm), lambda: _expected(vlm))


def _expected(vlm: Path) -> dict[str, list[str]]:
    out = {}
    for name, (messages, pictures) in CHATS.items():
        shown = [{**m, "content": as_mlx_vlm(m["content"])} if isinstance(m["content"], list) else m for m in messages]
        out[name] = mlx_vlm_tokens(vlm, shown, pictures)
    return out


# Under TP and PP the prompts go in chunks that cut the images, as a long image prompt's do.
@pytest.fixture(
    scope="module",
    params=[(), ("--tp", "2", "--prefill-chunk", "7"), ("--pp", "2", "--prefill-chunk", "5")],
    ids=["tp1", "tp2", "pp2"],
)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vlm: Path) -> Iterator[Server]:
    with serving(tmp_path_factory, "--model", str(vlm), *request.param) as server:
        yield server


def test_greedy_output_equals_mlx_vlm_with_images_and_without(
    served: Server, vlm: Path, expected: dict[str, list[str]]
) -> None:
    got = {}
    with httpx.Client(base_url=served.url, timeout=120) as client:
        for name, (messages, _) in CHATS.items():
            body = {"model": vlm.name, "messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True}
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            got[name] = [t["token"] for t in reply.json()["choices"][0]["logprobs"]["content"]]
            if name == "image":  # the window is passed: the prompt is longer than the sliding layers see
                assert reply.json()["usage"]["prompt_tokens"] > 24
    assert got == expected
    assert len(set(expected["image"])) > 3 and expected["image"] != expected["text"]  # the tokens mean something


@pytest.mark.anyio
async def test_batched_image_and_text_chats_each_equal_their_solo_output_and_a_next_turn_hits_the_cache(
    served: Server, vlm: Path
) -> None:
    bodies = [
        {"model": vlm.name, "messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True}
        for messages, _ in CHATS.values()
    ]
    solo, together = await solo_and_together(served.url, [*bodies, bodies[0]])
    assert together == solo
    # The next turn after an image: its prompt extends the first's, which the cache holds whole (a sliding
    # window's cache is restored whole or not at all, so the very same prompt again would restore nothing).
    first = bodies[0]["messages"]
    follow = [*first, {"role": "assistant", "content": "A picture."}, {"role": "user", "content": "More?"}]
    with httpx.Client(base_url=served.url, timeout=120) as client:
        reply = client.post("/v1/chat/completions", json={**bodies[0], "messages": follow}).json()
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 24, reply["usage"]  # past the image
