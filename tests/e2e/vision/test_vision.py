"""Images in: a tiny random Mistral 3 (mlx-vlm's vision tower, projector and language model) served by neuron at
TP=1, TP=2 and PP=2 gives mlx-vlm's own greedy tokens for the same image and prompt; the prefix cache keys on the
picture; and every hostile image is refused with a 400 that names the part, the server staying up. Reading images
without a server: tests/unit/test_vision.py."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import openai
import pytest

from testkit.origin import origin
from testkit.server import Server, serving
from testkit.vision import (
    as_mlx_vlm,
    data_url,
    make_tiny_mistral3,
    mlx_vlm_tokens,
    png,
    png_claiming,
    solo_and_together,
    tokens_of,
    truncated_jpeg,
)

PROMPT = "Describe this."


def chat(content: str | list[dict], max_tokens: int = 12) -> dict:
    return {
        "model": "mistral3",
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "messages": [{"role": "user", "content": content}],
    }


def image_parts(*pictures: bytes, text: str = PROMPT) -> list[dict]:
    return [
        *({"type": "image_url", "image_url": {"url": data_url(p)}} for p in pictures),
        {"type": "text", "text": text},
    ]


# End to end: a real server, the official client, mlx-vlm's own generation as the reference.


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mistral3(tmp_path_factory.mktemp("vlm") / "mistral3")


@pytest.fixture(scope="module")
def picture() -> bytes:
    return png(64, 48, seed=1)


# A conversation with an image in an earlier turn and two in the last.
TURNS = [
    {"role": "user", "content": image_parts(png(32, 48, seed=5), text="What is this?")},
    {"role": "assistant", "content": "A square."},
    {"role": "user", "content": image_parts(png(64, 32, seed=6), png(32, 32, seed=7), text="And these two?")},
]
TURN_PICTURES = [png(32, 48, seed=5), png(64, 32, seed=6), png(32, 32, seed=7)]


@pytest.fixture(scope="module")
def expected(vlm: Path, picture: bytes) -> dict[str, list[str]]:
    user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    turns = [{**m, "content": as_mlx_vlm(m["content"])} if isinstance(m["content"], list) else m for m in TURNS]
    return {
        "image": mlx_vlm_tokens(vlm, user, [picture]),
        "text": mlx_vlm_tokens(vlm, [{"role": "user", "content": PROMPT}], []),
        "turns": mlx_vlm_tokens(vlm, turns, TURN_PICTURES),
    }


@pytest.fixture(scope="module", params=[(), ("--tp", "2"), ("--pp", "2")], ids=["tp1", "tp2", "pp2"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vlm: Path) -> Iterator[Server]:
    with serving(tmp_path_factory, "--model", str(vlm), *request.param) as server:
        yield server


def test_greedy_output_equals_mlx_vlm_on_the_same_image(
    served: Server, picture: bytes, expected: dict[str, list[str]]
) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x")
    reply = client.chat.completions.create(**chat(image_parts(picture)))  # type: ignore[call-overload]
    assert tokens_of(reply.model_dump()) == expected["image"]
    assert reply.usage is not None and reply.usage.prompt_tokens > 15  # the image's tokens count as prompt tokens
    streamed = client.chat.completions.create(**chat(image_parts(picture)), stream=True)  # type: ignore[call-overload]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == reply.choices[0].message.content
    # A text-only request to the same model is what mlx-vlm generates without an image.
    plain = client.chat.completions.create(**chat(PROMPT))  # type: ignore[call-overload]
    assert tokens_of(plain.model_dump()) == expected["text"]


def test_several_images_and_images_in_earlier_turns_equal_mlx_vlm(
    served: Server, expected: dict[str, list[str]]
) -> None:
    reply = httpx.post(f"{served.url}/v1/chat/completions", json={**chat(""), "messages": TURNS}, timeout=120)
    assert tokens_of(reply.json()) == expected["turns"]


def test_responses_input_image_and_anthropic_image_blocks_read_as_chat_image_url(
    served: Server, picture: bytes, expected: dict[str, list[str]]
) -> None:
    import anthropic

    if len(served.args) > 2:
        pytest.skip("the APIs are shown at TP=1; the ranks see the same prompt from each")
    want = "".join(expected["image"])
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x")
    content = [{"type": "input_image", "image_url": data_url(picture)}, {"type": "input_text", "text": PROMPT}]
    ask = {"model": "mistral3", "input": [{"role": "user", "content": content}], "max_output_tokens": 12}
    assert client.responses.create(**ask, temperature=0).output_text == want  # type: ignore[call-overload]
    streamed = client.responses.create(**ask, temperature=0, stream=True)  # type: ignore[call-overload]
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == want
    claude = anthropic.Anthropic(base_url=served.url, api_key="x")
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(picture).decode()}
    blocks = [{"type": "image", "source": source}, {"type": "text", "text": PROMPT}]
    message = claude.messages.create(
        model="mistral3", max_tokens=12, messages=[{"role": "user", "content": blocks}], extra_body={"temperature": 0}
    )
    assert "".join(b.text for b in message.content if b.type == "text") == want
    with claude.messages.stream(
        model="mistral3", max_tokens=12, messages=[{"role": "user", "content": blocks}], extra_body={"temperature": 0}
    ) as stream:
        assert "".join(stream.text_stream) == want


def test_a_repeated_image_reuses_the_cache_and_one_changed_pixel_does_not(served: Server) -> None:
    from PIL import Image

    first = png(64, 64, seed=11)
    changed = Image.open(io.BytesIO(first)).convert("RGB")
    changed.putpixel((10, 20), (0, 0, 0) if changed.getpixel((10, 20)) != (0, 0, 0) else (1, 1, 1))
    out = io.BytesIO()
    changed.save(out, format="PNG")
    with httpx.Client(base_url=served.url, timeout=120) as client:
        cold = client.post("/v1/chat/completions", json=chat(image_parts(first), max_tokens=4)).json()
        longer = image_parts(first, text=PROMPT + " In detail, please.")
        warm = client.post("/v1/chat/completions", json=chat(longer, max_tokens=4)).json()
        other = image_parts(out.getvalue(), text=PROMPT + " In detail, please.")
        miss = client.post("/v1/chat/completions", json=chat(other, max_tokens=4)).json()
        alone = client.post("/v1/chat/completions", json=chat(other, max_tokens=4)).json()
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (cold, warm, miss)]
    image_start = 6  # "[INST]" is six one-character tokens; the image's tokens follow
    # The longer prompt shares the first up to its closing "[/INST]" (seven one-character tokens): all restored.
    assert cached[1] == cold["usage"]["prompt_tokens"] - len("[/INST]"), cached
    assert cached[2] <= image_start, cached  # the changed picture matches nothing past the text before it
    assert tokens_of(miss) == tokens_of(alone)


@pytest.mark.anyio
async def test_batched_with_image_and_text_requests_each_equals_its_solo_output(served: Server) -> None:
    bodies = [
        chat(image_parts(png(64, 64, seed=21)), max_tokens=10),
        chat(image_parts(png(48, 64, seed=22), text="What is it?"), max_tokens=10),
        chat("Tell me something.", max_tokens=10),
        chat(image_parts(png(32, 32, seed=23), png(64, 32, seed=24), text="Compare them."), max_tokens=10),
    ]
    solo, together = await solo_and_together(served.url, bodies)
    assert together == solo


@pytest.fixture(scope="module")
def text_only(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]) -> Iterator[Server]:
    with serving(tmp_path_factory, "--model", str(tiny_models["qwen3"])) as server:
        yield server


def test_an_image_to_a_text_only_model_is_a_400_naming_the_part(text_only: Server, picture: bytes) -> None:
    body = {**chat([{"type": "text", "text": "look:"}, *image_parts(picture)]), "model": "qwen3"}
    reply = httpx.post(f"{text_only.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "reads text only" in error["message"]


def test_the_status_says_whether_the_model_takes_images(text_only: Server, served: Server) -> None:
    """The page offers to attach an image only where ``/v1/status`` says the model takes them."""
    assert httpx.get(f"{text_only.url}/v1/status", timeout=60).json()["model"]["vision"] is False
    assert httpx.get(f"{served.url}/v1/status", timeout=60).json()["model"]["vision"] is True


def test_hostile_images_get_a_4xx_in_bounded_time_and_the_server_stays_up(
    served: Server, picture: bytes, expected: dict[str, list[str]]
) -> None:
    if len(served.args) > 2:  # one server shows it; the others run the same intake
        pytest.skip("shown at TP=1")
    hostile = {
        "50000x50000 header": image_parts(png_claiming(50_000, 50_000)),
        "truncated jpeg": image_parts(truncated_jpeg()),
        "compressed bomb": image_parts(png_claiming(5_000, 5_000, rows=5_000)),
        "100 images": image_parts(*[picture] * 100),
        "file url": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
        "closed port": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}],
    }
    with httpx.Client(base_url=served.url, timeout=30) as client:
        for name, content in hostile.items():
            started = time.monotonic()
            reply = client.post("/v1/chat/completions", json=chat(content))
            assert reply.status_code == 400, (name, reply.text)
            assert reply.json()["error"]["param"].startswith("messages"), name
            assert time.monotonic() - started < 10, name
        reply = client.post("/v1/chat/completions", json=chat(image_parts(picture))).json()
    assert tokens_of(reply) == expected["image"]


@pytest.fixture(scope="module")
def chunked(tmp_path_factory: pytest.TempPathFactory, vlm: Path) -> Iterator[Server]:
    """Prompts fed 7 tokens a step, so that images are cut across steps; the image caps set low; image URLs
    fetched."""
    args = ("--prefill-chunk", "7", "--max-images", "3", "--max-image-pixels", "3100", "--tp", "2")
    # Image URLs fetched, from this host's own test server too.
    args += ("--image-urls", "--image-urls-private")
    with serving(tmp_path_factory, "--model", str(vlm), *args) as server:
        yield server


def test_images_cut_across_prefill_chunks_give_the_same_tokens(
    chunked: Server, picture: bytes, expected: dict[str, list[str]]
) -> None:
    with httpx.Client(base_url=chunked.url, timeout=120) as client:
        assert (
            tokens_of(client.post("/v1/chat/completions", json=chat(image_parts(picture))).json()) == expected["image"]
        )
        turns = client.post("/v1/chat/completions", json={**chat(""), "messages": TURNS}).json()
    assert tokens_of(turns) == expected["turns"]


def test_the_image_caps_are_the_servers_settings(chunked: Server, picture: bytes) -> None:
    with httpx.Client(base_url=chunked.url, timeout=60) as client:
        four = client.post("/v1/chat/completions", json=chat(image_parts(*[picture] * 4)))
        large = client.post("/v1/chat/completions", json=chat(image_parts(png(64, 64))))
    assert four.status_code == 400 and "at most 3 a request (--max-images)" in four.json()["error"]["message"]
    assert large.status_code == 400 and "at most 3,100 pixels" in large.json()["error"]["message"]
    assert large.json()["error"]["param"] == "messages[0].content[0].image_url.url"


def test_prompt_logprobs_with_images_are_refused_not_computed_without_them(served: Server, picture: bytes) -> None:
    if len(served.args) > 2:
        pytest.skip("shown at TP=1")
    body = {**chat(image_parts(picture), max_tokens=2), "prompt_logprobs": 1}
    reply = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_logprobs", reply.text


def test_an_image_url_is_fetched_where_the_server_allows_it(
    chunked: Server, picture: bytes, expected: dict[str, list[str]]
) -> None:
    with origin({"/a.png": picture}) as url, httpx.Client(base_url=chunked.url, timeout=120) as client:
        fetched = client.post("/v1/chat/completions", json=chat(_url_parts(f"{url}/a.png")))
        redirected = client.post("/v1/chat/completions", json=chat(_url_parts(f"{url}/redirect")))
        missing = client.post("/v1/chat/completions", json=chat(_url_parts(f"{url}/missing")))
    assert tokens_of(fetched.json()) == tokens_of(redirected.json()) == expected["image"]
    assert missing.status_code == 400 and "answered HTTP 404" in missing.json()["error"]["message"]
    assert missing.json()["error"]["param"] == "messages[0].content[0].image_url.url"


def _url_parts(url: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]


def gradient(side: int) -> bytes:
    """A large picture that compresses to little: decoding and processing it take about a second."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, side, dtype=np.uint8)
    pixels = np.stack([np.tile(ramp, (side, 1)), np.tile(ramp[:, None], (1, side)), np.zeros((side, side), np.uint8)])
    out = io.BytesIO()
    Image.fromarray(pixels.transpose(1, 2, 0)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.anyio
async def test_large_images_are_read_off_the_event_loop(served: Server) -> None:
    """While a request's large image is decoded and processed (a second or more), every other request is answered: the
    longest wait between two health checks is a small part of the image request's time, where a blocked event
    loop would answer none of them until the images were done."""
    if len(served.args) > 2:
        pytest.skip("shown at TP=1")
    body = chat(image_parts(gradient(4096)), max_tokens=1)
    gaps: list[float] = []
    async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
        done = anyio.Event()
        took: list[float] = []

        async def with_images() -> None:
            started = time.monotonic()
            reply = await client.post("/v1/chat/completions", json=body)
            took.append(time.monotonic() - started)
            assert reply.status_code == 200, reply.text
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(with_images)
            last = time.monotonic()
            with anyio.fail_after(120):
                while not done.is_set():
                    assert (await client.get("/health")).status_code == 200
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()
    assert len(gaps) >= 3 and max(gaps) < took[0] / 3, (max(gaps), took, len(gaps))


def _sized_request(url: str, length: int) -> int:
    """The status a chat request declaring a body of ``length`` bytes gets, sent before its body."""
    import socket
    from urllib.parse import urlsplit

    at = urlsplit(url)
    with socket.create_connection((at.hostname, at.port), timeout=30) as conn:
        conn.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {at.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n".encode()
        )
        return int(conn.recv(1024).split(b" ", 2)[1])


def test_a_photo_over_4_mib_is_taken_and_a_body_over_the_image_limit_is_a_413(
    served: Server, text_only: Server
) -> None:
    if len(served.args) > 2:
        pytest.skip("shown at TP=1")
    photo = png(1200, 1200, seed=9)  # noise: 4.3 MB as PNG, 5.8 MB in base64
    body = chat(image_parts(photo), max_tokens=2)
    with httpx.Client(timeout=120) as client:
        taken = client.post(f"{served.url}/v1/chat/completions", json=body)
        text = client.post(f"{text_only.url}/v1/chat/completions", json={**body, "model": "qwen3"})
    assert taken.status_code == 200, taken.text
    assert taken.json()["usage"]["prompt_tokens"] > 15
    # A text-only model's bodies stay at most 4 MiB.
    assert text.status_code == 413 and "4,194,304 bytes" in text.json()["error"]["message"]
    assert _sized_request(served.url, 64 * 2**20 + 1) == 413  # --max-image-body-bytes' default
