"""A message's content parts turned into what the model reads, for every family: OpenAI's chat parts, the
Responses API's parts and Anthropic's content blocks. Today each kind of part must be text; a new kind of part
(an image) is added here, with the schema beside each reader. No MLX, no HTTP.
"""

from __future__ import annotations

from typing import Any

from neuron.server.common.errors import bad
from neuron.server.common.fields import type_of

# OpenAI's chat: `content` is a string, null, or an array of parts.
CHAT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
# The Responses API: a message's `content` is a string or an array of these parts.
RESPONSES_PARTS = ("input_text", "output_text")
RESPONSES_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": list(RESPONSES_PARTS)}, "text": {"type": "string"}},
}
# Anthropic's Messages API: `system`, a turn's `content` and a tool result's `content` hold text blocks.
ANTHROPIC_TEXT = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}


def chat_text(value: Any, where: str) -> str:
    """A chat message's ``content``."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if not isinstance(value, list):
        raise bad(where, f"`{where}` must be a string or an array of text parts, got {type_of(value)}")
    parts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            named = part.get("type") if isinstance(part, dict) else type_of(part)
            raise bad(f"{where}[{i}]", f"`{where}[{i}]` is a {named!r} part; this model reads text parts only")
        parts.append(part["text"])
    return "".join(parts)


def responses_text(value: Any, where: str) -> str:
    """A Responses API message's ``content``."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(where, f"`{where}` must be a string or an array of text parts, got {type_of(value)}")
    parts = []
    for i, part in enumerate(value):
        if (
            not isinstance(part, dict)
            or part.get("type") not in RESPONSES_PARTS
            or not isinstance(part.get("text"), str)
        ):
            raise bad(f"{where}[{i}]", f"`{where}[{i}]` must be an input_text or output_text part")
        parts.append(part["text"])
    return "".join(parts)


def anthropic_text(blocks: list[Any], where: str) -> str:
    """Anthropic content blocks that must all be text."""
    return "".join(anthropic_block(block, f"{where}[{i}]") for i, block in enumerate(blocks))


def anthropic_block(block: Any, where: str) -> str:
    """One Anthropic content block that must be text."""
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        named = block.get("type") if isinstance(block, dict) else type_of(block)
        raise bad(where, f"`{where}` is a {named!r} block; this model reads text blocks only")
    return block["text"]
