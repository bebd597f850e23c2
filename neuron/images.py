"""Images a request carries: named by a ``data:`` URL (or an ``http(s)`` one, where the server fetches them),
checked, decoded once, digested.

No MLX here. The HTTP layer reads a request in two moves: while it parses the
body, ``part`` checks what is cheap to check (the URL's kind, the payload's
size) and leaves a ``Source`` in the part; before the request queues, each
source is read and decoded (``read``) on a worker thread, off the event loop.
Every refusal (a payload that is no image, a format Pillow does not decode, a
picture too large, too many of them) is a 400 naming the part, before anything
queues. A picture's size is read from its header and checked before a single
pixel is decoded: a decompression bomb (a few KB of PNG that would decode to
gigabytes) is refused unread.

The digest is of the decoded pixels (and their size), not of the bytes sent:
the same picture sent as PNG or re-encoded hits the same prefix-cache entry,
and one changed pixel is another picture.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass, field
from typing import Any

from neuron.config.settings import ImageLimits

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# The server's --max-images and --max-image-pixels, set once at startup (``neuron serve``), before any request is read.
LIMITS = ImageLimits()


class ImageError(ValueError):
    """A part that is no usable image; ``param`` names it (``messages[0].content[1]``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Source:
    """An image a request names, not read yet: its URL (checked for its kind and size) and the part it came in."""

    url: str
    where: str  # the part, as a request names it (``messages[0].content[1].image_url.url``)

    @property
    def remote(self) -> bool:
        return not self.url[:5].lower().startswith("data:")


@dataclass(frozen=True, slots=True)
class Picture:
    """A decoded image: RGB, its first frame where it has several."""

    digest: str  # sha256 of its size and RGB pixels
    width: int
    height: int
    image: Any = field(repr=False, compare=False)  # PIL.Image.Image, RGB


def part(value: Any, where: str) -> dict[str, Any]:
    """OpenAI's ``image_url`` part's object (``{"url": ..., "detail": ...}``) as a chat template's image part:
    ``{"type": "image", "picture": Source}`` (templates render ``{"type": "image"}``), its URL checked; ``read``
    turns the source into a ``Picture``."""
    url = value.get("url") if isinstance(value, dict) else value
    return {"type": "image", "picture": checked(url, f"{where}.image_url.url")}


def from_responses(part: Any) -> dict[str, Any] | None:
    """The Responses API's ``input_image`` part as a chat's ``image_url`` part; None for any other part."""
    if not isinstance(part, dict) or part.get("type") != "input_image":
        return None
    return {"type": "image_url", "image_url": {"url": part.get("image_url")}}


def from_anthropic(block: Any) -> dict[str, Any] | None:
    """Anthropic's ``image`` block (a base64 ``source``, or a ``url`` one) as a chat's ``image_url`` part; None for
    any other block."""
    if not isinstance(block, dict) or block.get("type") != "image":
        return None
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    url: Any = source.get("url")
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    return {"type": "image_url", "image_url": {"url": url}}


def joined(parts: list[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content: its text where it holds only text (as before images), else its parts in order."""
    if all(isinstance(p, str) for p in parts):
        return "".join(p for p in parts if isinstance(p, str))
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every image part of a chat, in the order its template renders them."""
    return [
        p
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image"
    ]


def pictures(messages: list[dict[str, Any]]) -> list[Picture]:
    """Every image of a chat, read (``read``), in the order its template renders them."""
    out = [p["picture"] for p in image_parts(messages)]
    unread = [p for p in out if not isinstance(p, Picture)]
    if unread:
        raise RuntimeError(f"{unread[0]} was not read before its chat was encoded")
    return out


def first_image(messages: list[dict[str, Any]]) -> str:
    """Where a chat's first image part is, as a request names it (``messages[1].content[0]``)."""
    for i, m in enumerate(messages):
        content = m.get("content")
        for j, p in enumerate(content if isinstance(content, list) else []):
            if isinstance(p, dict) and p.get("type") == "image":
                return f"messages[{i}].content[{j}]"
    return "messages"


def check_count(messages: list[dict[str, Any]], where: str = "messages", most: int | None = None) -> None:
    most = LIMITS.max_images if most is None else most
    if (seen := len(image_parts(messages))) > most:
        raise ImageError(
            f"`{where}` carries {seen} images; this server takes at most {most} a request (--max-images): send fewer",
            where,
        )


def checked(url: Any, where: str) -> Source:
    """The source an ``image_url``'s ``url`` names, checked without reading it: a ``data:`` URL (base64) of at
    most --max-image-bytes, or an ``http(s)`` URL where the server fetches them (--image-urls)."""
    if not isinstance(url, str):
        raise ImageError(f"`{where}` must be a string: a data: URL of a base64 image", where)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        if not LIMITS.image_urls:
            raise ImageError(
                f"`{where}`: this server does not fetch image URLs (a server-side request forgery risk; its "
                "operator may allow them with --image-urls); send the image inline as a data: URL, "
                "data:image/png;base64,...",
                where,
            )
        return Source(url, where)
    if scheme != "data":
        shown = f"a {scheme}: URL" if scheme else "no URL"
        raise ImageError(
            f"`{where}` is {shown}; send the image inline as a data: URL, data:image/png;base64,...", where
        )
    header, _, payload = url.partition(",")
    if not header.lower().endswith(";base64"):
        raise ImageError(f"`{where}`: the data: URL must be base64 (data:image/png;base64,...)", where)
    if len(payload) > LIMITS.max_image_bytes * 4 // 3 + 4:
        raise too_large(where)
    return Source(url, where)


def too_large(where: str) -> ImageError:
    most = LIMITS.max_image_bytes
    return ImageError(
        f"`{where}`: an image may take at most {most:,} bytes (--max-image-bytes); send a smaller one", where
    )


def read(source: Source, fetched: bytes | None = None) -> Picture:
    """The picture a source names: its ``data:`` URL's bytes, or the bytes ``fetched`` from its ``http(s)`` URL,
    decoded. Seconds for a large photo: called off the event loop."""
    if fetched is not None:
        return decode(fetched, source.where)
    return from_base64(source.url.partition(",")[2], source.where)


def from_url(url: Any, where: str) -> Picture:
    """The picture a ``data:`` URL holds, checked and decoded."""
    source = checked(url, where)
    if source.remote:
        raise ImageError(f"`{where}`: an http(s) URL is fetched, not read in place", where)
    return read(source)


def from_base64(payload: Any, where: str) -> Picture:
    if not isinstance(payload, str):
        raise ImageError(f"`{where}` must be a base64 string", where)
    if len(payload) > LIMITS.max_image_bytes * 4 // 3 + 4:
        raise too_large(where)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"`{where}` is not valid base64 ({e}); encode the image's bytes in base64", where) from e
    return decode(data, where)


def decode(data: bytes, where: str, max_pixels: int | None = None) -> Picture:
    """Check the header, then decode the first frame as RGB; refusals name ``where`` and what to send instead."""
    max_pixels = LIMITS.max_image_pixels if max_pixels is None else max_pixels
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(data))  # reads the header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"`{where}` claims too many pixels ({_reason(e)}); scale it down", where) from e
    except (UnidentifiedImageError, OSError) as e:
        raise ImageError(
            f"`{where}` is not an image neuron can read ({_reason(e)}); send a PNG, JPEG, WebP or GIF", where
        ) from e
    with opened:
        if opened.format not in FORMATS:
            raise ImageError(
                f"`{where}` is a {opened.format} image; send a PNG, JPEG, WebP or GIF ({opened.format} is not read)",
                where,
            )
        width, height = opened.size
        if width < 1 or height < 1 or width * height > max_pixels:
            raise ImageError(
                f"`{where}` is {width}x{height} pixels; this server takes at most {max_pixels:,} pixels an image "
                "(--max-image-pixels): scale it down",
                where,
            )
        try:
            opened.seek(0)  # a GIF's or an animated WebP's first frame
            rgb = opened.convert("RGB")
        except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated or corrupt past the header
            raise ImageError(
                f"`{where}`: the {opened.format} image is damaged or cut short ({_reason(e)}); send the whole file",
                where,
            ) from e
    digest = hashlib.sha256(f"{width}x{height}:".encode() + rgb.tobytes()).hexdigest()
    return Picture(digest, width, height, rgb)


def _reason(error: BaseException) -> str:
    return str(error).split("\n", 1)[0][:160] or type(error).__name__


@dataclass(frozen=True, slots=True)
class Inputs:
    """One image's inputs to its model's vision encoder, as the model's processor made them for the image alone:
    ``ids`` (the image's placeholder tokens, the ``token`` among them marking where its features go) and
    ``arrays`` (numpy: pixel values, sizes, grids), the keyword arguments of mlx-vlm's ``get_input_embeddings``."""

    ids: list[int]
    arrays: dict[str, Any]
    token: int

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(a, "nbytes", 0)) for a in self.arrays.values())
