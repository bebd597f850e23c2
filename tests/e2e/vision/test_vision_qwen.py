"""Images in for the Qwen families: a tiny random Qwen3-VL (mlx-vlm's vision tower with deepstack mergers, a qwen3
language model with multimodal rotary positions) served at TP=1, TP=2 and PP=2 gives mlx-vlm's own greedy tokens
for the same images and prompt; TP=2 and PP=2 feed their prompts in small chunks, so that an image is cut across
steps; an image request batched with text-only ones gives each its solo output. The positions, decided without a
model: tests/unit/engine/test_vision_qwen.py."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from neuron.models import architectures
from testkit.server import Server, serving
from testkit.vision import Once, as_mlx_vlm, make_tiny_qwen3_vl, mlx_vlm_tokens, png, solo_and_together, tokens_of

PROMPT = "Describe this."


def image_parts(*pictures: bytes, text: str = PROMPT) -> list[dict]:
    urls = ("data:image/png;base64," + base64.b64encode(p).decode() for p in pictures)
    return [*({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": text}]


def chat(model: str, content: str | list[dict], max_tokens: int = 12) -> dict:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "messages": [{"role": "user", "content": content}],
    }


def name(server: Server) -> str:
    """The model a server serves: its folder's name."""
    return Path(server.args[server.args.index("--model") + 1]).name


# End to end: a real server, mlx-vlm's own generation as the reference.

TURN_PICTURES = [png(32, 48, seed=5), png(64, 32, seed=6), png(32, 32, seed=7)]
TURNS = [
    {"role": "user", "content": image_parts(TURN_PICTURES[0], text="What is this?")},
    {"role": "assistant", "content": "A square."},
    {"role": "user", "content": image_parts(*TURN_PICTURES[1:], text="And these two?")},
]


# Seeds whose random weights give tokens that change where an image token's positions, or the positions' lag
# after the image, are left out (checked by hand: with every position plain, the image prompts' tokens differ).
SEEDS = {"qwen3_vl": 0, "qwen3_5": 2, "qwen3_5_moe": 0}


@pytest.fixture(scope="module", params=list(SEEDS))
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, once: Once) -> Path:
    arch = request.param
    return once(
        arch, lambda: make_tiny_qwen3_vl(tmp_path_factory.mktemp("vlm") / arch, model_type=arch, seed=SEEDS[arch])
    )


@pytest.fixture(scope="module")
def picture() -> bytes:
    return png(64, 48, seed=1)


@pytest.fixture(scope="module")
def expected(vlm: Path, picture: bytes, once: Once) -> dict[str, list[str]]:
    return once(("expected", vlm), lambda: _expected(vlm, picture))


def _expected(vlm: Path, picture: bytes) -> dict[str, list[str]]:
    user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    turns = [{**m, "content": as_mlx_vlm(m["content"])} if isinstance(m["content"], list) else m for m in TURNS]
    longer = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT + " In detail."}]}]
    return {
        "image": mlx_vlm_tokens(vlm, user, [picture]),
        "longer": mlx_vlm_tokens(vlm, longer, [picture], max_tokens=4),
        "text": mlx_vlm_tokens(vlm, [{"role": "user", "content": PROMPT}], []),
        "turns": mlx_vlm_tokens(vlm, turns, TURN_PICTURES),
    }


@pytest.fixture(
    scope="module",
    # TP=2 runs each decode step ahead of its plan, as on a GPU, where the model's caches allow it.
    params=[(), ("--tp", "2", "--prefill-chunk", "7", "--run-ahead", "on"), ("--pp", "2", "--prefill-chunk", "5")],
    ids=["tp1", "tp2-chunked", "pp2-chunked"],
)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vlm: Path) -> Iterator[Server]:
    with serving(tmp_path_factory, "--model", str(vlm), *request.param) as server:
        yield server


def test_greedy_output_equals_mlx_vlm_with_images_and_without(
    served: Server, picture: bytes, expected: dict[str, list[str]]
) -> None:
    assert len(set(expected["image"]) | set(expected["turns"])) > 8  # the tokens say something
    with httpx.Client(base_url=served.url, timeout=120) as client:
        image = client.post("/v1/chat/completions", json=chat(name(served), image_parts(picture))).json()
        text = client.post("/v1/chat/completions", json=chat(name(served), PROMPT)).json()
        turns = client.post("/v1/chat/completions", json={**chat(name(served), ""), "messages": TURNS}).json()
    assert tokens_of(image) == expected["image"]
    assert image["usage"]["prompt_tokens"] > 20  # the image's tokens count as prompt tokens
    assert tokens_of(text) == expected["text"]  # a text-only request: mlx-vlm's (and mlx-lm's) text
    assert tokens_of(turns) == expected["turns"]  # an image in an earlier turn and two in the last


def test_drafts_and_a_restored_prefix_after_an_image_keep_its_positions(
    served: Server, picture: bytes, expected: dict[str, list[str]]
) -> None:
    """A predicted output drafts the reply: every draft token fed after the image at the lagging positions; and
    the same image and a longer text restore the first prompt's cache, the positions going on from there."""
    support = architectures.supports({"model_type": name(served)})
    assert support is not None
    prediction = {"type": "content", "content": "".join(expected["image"])}
    body = {**chat(name(served), image_parts(picture)), "prediction": prediction}
    with httpx.Client(base_url=served.url, timeout=120) as client:
        reply = client.post("/v1/chat/completions", json=body).json()
        longer = chat(name(served), image_parts(picture, text=PROMPT + " In detail."), max_tokens=4)
        extended = client.post("/v1/chat/completions", json=longer).json()
    assert tokens_of(reply) == expected["image"]
    accepted = reply["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
    assert accepted > 0 if support.speculation else accepted == 0  # qwen3_5's state caches cannot be cut: none
    if support.cuttable:  # a restored beginning past the image (a snapshot restores only a whole saved prompt)
        assert extended["usage"]["prompt_tokens_details"]["cached_tokens"] > 20
    assert tokens_of(extended) == expected["longer"]


@pytest.mark.anyio
async def test_batched_with_image_and_text_requests_each_equals_its_solo_output(served: Server) -> None:
    bodies = [
        chat(name(served), image_parts(png(64, 64, seed=21)), max_tokens=10),
        chat(name(served), "Tell me something.", max_tokens=10),
        chat(name(served), image_parts(png(48, 64, seed=22), text="What is it?"), max_tokens=10),
        chat(name(served), image_parts(png(32, 32, seed=23), png(64, 32, seed=24), text="Compare."), max_tokens=10),
    ]
    solo, together = await solo_and_together(served.url, bodies)
    assert together == solo


def test_a_rank_that_cannot_follow_a_plan_with_positions_runs_it_on_throwaway_caches(vlm: Path) -> None:
    """The desync path with M-RoPE: a chunk's positions that start past a fresh cache, and decode rows that lag,
    still run every pass on throwaway caches; the rank says why, and serves on."""
    from neuron.rank.rank import Rank, RankError
    from neuron.rpc import Decode, Prefill, StepPlan

    rank = Rank(0, 1)
    rank.load(str(vlm), [])
    rows = [[5, 6, 6, 7, 8, 9], [5, 6, 7, 7, 8, 9], [5, 6, 7, 8, 8, 9]]
    plan = StepPlan(
        prefill=[Prefill(2, 5, [10, 11, 12, 13, 14, 15], False, positions=rows)],
        decode=[Decode(3, 7, 0, rope_delta=-3)],
    )
    with pytest.raises(RankError, match="desync"):
        rank.step(plan)
    logits = rank.step(StepPlan(prefill=[Prefill(1, 0, [10, 11, 12, 13, 14, 15], True, positions=rows)]))
    assert logits is not None and 1 in logits
