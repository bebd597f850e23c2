"""A message's content parts turned into what the model reads, for every family: OpenAI's chat parts, the
Responses API's parts and Anthropic's content blocks. Each part is text or an image: the Responses API's
``input_image`` and Anthropic's ``image`` blocks become a chat's ``image_url`` part, and a chat's ``image_url`` is
checked here as the body is parsed and read (fetched, decoded) by ``read_images`` before the request queues, on
a worker thread (``off_loop``): a bad image is a 400 naming its part before anything queues, and a large photo never
holds up the event loop. The schema sits beside each reader. No MLX.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import anyio

from neuron import images
from neuron.server.common.errors import bad
from neuron.server.common.fields import type_of

# OpenAI's chat: `content` is a string, null, or an array of parts.
CHAT_PART = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        },
        {
            "type": "object",
            "required": ["type", "image_url"],
            "properties": {
                "type": {"const": "image_url"},
                "image_url": {"type": "object", "required": ["url"], "properties": {"url": {"type": "string"}}},
            },
        },
    ]
}
# The Responses API: a message's `content` is a string or an array of these parts.
RESPONSES_PARTS = ("input_text", "output_text")
RESPONSES_PART = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"enum": list(RESPONSES_PARTS)}, "text": {"type": "string"}},
        },
        {
            "type": "object",
            "required": ["type", "image_url"],
            "properties": {"type": {"const": "input_image"}, "image_url": {"type": "string"}},
        },
    ]
}
# Anthropic's Messages API: `system`, a turn's `content` and a tool result's `content` hold text blocks.
ANTHROPIC_TEXT = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
# A user turn's image block: base64 (`source.type` base64, `media_type`, `data`).
ANTHROPIC_IMAGE = {
    "type": "object",
    "required": ["type", "source"],
    "properties": {"type": {"const": "image"}, "source": {"type": "object"}},
}


def chat_text(value: Any, where: str) -> str | list[dict[str, Any]]:
    """A chat message's ``content``: its text, or its parts where it holds images (each decoded, ``images.part``)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if not isinstance(value, list):
        raise bad(where, f"`{where}` must be a string or an array of text parts, got {type_of(value)}")
    parts: list[str | dict[str, Any]] = []
    for i, part in enumerate(value):
        if isinstance(part, dict) and part.get("type") == "image_url":
            try:
                parts.append(images.part(part.get("image_url"), f"{where}[{i}]"))
            except images.ImageError as e:
                raise bad(e.param, str(e)) from e
            continue
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            named = part.get("type") if isinstance(part, dict) else type_of(part)
            raise bad(f"{where}[{i}]", f"`{where}[{i}]` is a {named!r} part; this model reads text parts only")
        parts.append(part["text"])
    return images.joined(parts)


T = TypeVar("T")
# Images read and chats encoded with images at once: a burst of photos takes this many of the two or so cores a
# small host has, and queues the rest.
IMAGE_THREADS = 2
_threads: ThreadPoolExecutor | None = None


async def off_loop(work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` on one of ``IMAGE_THREADS`` threads kept for it: decoding a photo and running a processor
    over it take up to seconds, which the event loop, answering every other request meanwhile, must not wait out.
    The threads live as long as the server, not a worker pool's few idle seconds: mlx-vlm's processors make MLX
    arrays, and MLX keeps a stream per thread (FACTS: use MLX on threads of your own). Waited for even when the
    request is cancelled, as ``anyio.to_thread`` waits: its work never outlives its caller."""
    global _threads
    if _threads is None:
        _threads = ThreadPoolExecutor(IMAGE_THREADS, thread_name_prefix="neuron-images")
    done = asyncio.get_running_loop().run_in_executor(_threads, partial(work, *args))
    with anyio.CancelScope(shield=True):
        result = await done
    return result


async def read_images(messages: list[dict[str, Any]]) -> None:
    """Each image part's source (``images.Source``) read in place as its ``images.Picture``: fetched where it is
    an http(s) URL (``fetch``), decoded off the event loop; a refusal is a 400 naming the part."""
    for part in images.image_parts(messages):
        source = part["picture"]
        if not isinstance(source, images.Source):
            continue
        try:
            fetched = None
            if source.remote:
                from neuron.server.common import fetch  # httpx: an install that takes images (neuron[vision])

                fetched = await fetch.image(source.url, source.where)
            part["picture"] = await off_loop(images.read, source, fetched)
        except images.ImageError as e:
            raise bad(e.param, str(e)) from e


def check_images(messages: list[dict[str, Any]]) -> None:
    """A chat's images, counted across its messages against the server's --max-images."""
    try:
        images.check_count(messages)
    except images.ImageError as e:
        raise bad(e.param, str(e)) from e


def responses_text(value: Any, where: str) -> str | list[dict[str, Any]]:
    """A Responses API message's ``content``: its text, or its parts, each ``input_image`` a chat's ``image_url``."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(where, f"`{where}` must be a string or an array of text parts, got {type_of(value)}")
    parts: list[str | dict[str, Any]] = []
    for i, part in enumerate(value):
        if (image := images.from_responses(part)) is not None:
            parts.append(image)
            continue
        if (
            not isinstance(part, dict)
            or part.get("type") not in RESPONSES_PARTS
            or not isinstance(part.get("text"), str)
        ):
            raise bad(f"{where}[{i}]", f"`{where}[{i}]` must be an input_text or output_text part")
        parts.append(part["text"])
    return images.joined(parts)


def anthropic_text(blocks: list[Any], where: str) -> str:
    """Anthropic content blocks that must all be text."""
    return "".join(anthropic_block(block, f"{where}[{i}]") for i, block in enumerate(blocks))


def anthropic_user(blocks: list[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A user turn's content from its blocks read in order (``anthropic_part``): text, or parts with images."""
    return images.joined(blocks)


def anthropic_part(block: Any, where: str) -> str | dict[str, Any]:
    """One block of a user turn: text, or an ``image`` block as a chat's ``image_url`` part."""
    if (image := images.from_anthropic(block)) is not None:
        return image
    return anthropic_block(block, where)


def anthropic_block(block: Any, where: str) -> str:
    """One Anthropic content block that must be text."""
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        named = block.get("type") if isinstance(block, dict) else type_of(block)
        raise bad(where, f"`{where}` is a {named!r} block; this model reads text blocks only")
    return block["text"]
