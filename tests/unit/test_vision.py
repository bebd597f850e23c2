"""Images read (neuron/images.py) and placed in a prompt (``engine.image_prompts``), no model: the formats Pillow
decodes, the digest the prefix cache keys on, hostile payloads and URLs refused before decoding, where each image's
features go. Served by a real vision-language model: tests/e2e/vision/."""

from __future__ import annotations

import io
import time

import pytest

from neuron import images
from neuron.engine.image_prompts import PromptImage, keyed, runs
from neuron.rpc import ImageRun
from testkit.vision import data_url, png, png_claiming, truncated_jpeg


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_the_formats_pillow_decodes_are_read_as_rgb(fmt: str) -> None:
    picture = images.from_url(data_url(png(40, 30, seed=3, fmt=fmt)), "p")
    assert (picture.width, picture.height, picture.image.mode) == (40, 30, "RGB")


def test_the_digest_is_of_the_pixels_and_one_pixel_changes_it() -> None:
    from PIL import Image

    one = images.decode(png(16, 16, seed=1), "p")
    again = images.decode(png(16, 16, seed=1), "p")
    changed = one.image.copy()
    changed.putpixel((3, 4), tuple((c + 1) % 256 for c in changed.getpixel((3, 4))))
    out = io.BytesIO()
    changed.save(out, format="PNG")
    assert one.digest == again.digest
    assert images.decode(out.getvalue(), "p").digest != one.digest
    # The same pixels sent in another lossless format are the same picture.
    webp = io.BytesIO()
    Image.open(io.BytesIO(png(16, 16, seed=1))).save(webp, format="WEBP", lossless=True)
    assert images.decode(webp.getvalue(), "p").digest == one.digest


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (png_claiming(50_000, 50_000), "too many pixels"),  # Pillow's own bomb check, before any pixel
        (png_claiming(5_000, 5_000, rows=5_000), "at most 16,777,216 pixels"),  # 24 KB that would decode to 25 MB
        (truncated_jpeg(), "damaged or cut short"),
        (b"%PDF-1.4 not an image", "not an image neuron can read"),
    ],
    ids=["50000x50000-header", "compressed-bomb", "truncated-jpeg", "not-an-image"],
)
def test_hostile_payloads_are_refused_before_decoding_naming_the_part(payload: bytes, says: str) -> None:
    started = time.process_time()  # the work, which a loaded machine's wall clock would stretch
    with pytest.raises(images.ImageError, match=says) as refused:
        images.from_url(data_url(payload), "messages[0].content[1].image_url.url")
    assert refused.value.param == "messages[0].content[1].image_url.url"
    assert time.process_time() - started < 2


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("file:///etc/passwd", "a file: URL"),
        ("http://127.0.0.1:9/x.png", "does not fetch image URLs"),
        ("data:image/png,notbase64", "must be base64"),
        ("data:image/png;base64,@@@", "not valid base64"),
    ],
)
def test_urls_other_than_inline_base64_are_refused(url: str, says: str) -> None:
    with pytest.raises(images.ImageError, match=says):
        images.from_url(url, "p")


def test_runs_place_each_images_features_in_the_chunks_that_hold_them() -> None:
    # Two rows of two image tokens with a break between (positions 3, 4 | 6, 7), then a second image at 10, 11.
    prompt = (PromptImage("a" * 64, (3, 4, 6, 7)), PromptImage("b" * 64, (10, 11)))
    assert runs(prompt, 0, 20) == [
        ImageRun(3, 2, "a" * 64, 0),
        ImageRun(6, 2, "a" * 64, 2),
        ImageRun(10, 2, "b" * 64, 0),
    ]
    # A chunk that starts inside the first image: its rows from where the chunk starts.
    assert runs(prompt, 4, 11) == [
        ImageRun(0, 1, "a" * 64, 1),
        ImageRun(2, 2, "a" * 64, 2),
        ImageRun(6, 1, "b" * 64, 0),
    ]


def test_the_prefix_key_holds_the_picture_not_the_placeholder_token() -> None:
    tokens = [5, 6, 9, 9, 7]
    one = keyed(tokens, (PromptImage("1" * 64, (2, 3)),))
    other = keyed(tokens, (PromptImage("2" * 64, (2, 3)),))
    assert one[:2] == other[:2] == [5, 6] and one[4] == other[4] == 7
    assert one[2] != other[2] and all(k < 0 for k in one[2:4] + other[2:4])
    assert keyed(tokens, ()) == tokens
