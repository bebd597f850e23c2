"""A ``/v1/completions`` body checked into a ``Generation``: its prompts (texts or token ids), ``echo`` and
OpenAI's completions ``logprobs``; what it shares with a chat is ``common.generation``'s. No MLX, no HTTP.
"""

from __future__ import annotations

from typing import Any

from neuron.sampling_params import RANGES
from neuron.server.common.errors import bad
from neuron.server.common.fields import flag, integer, prompts
from neuron.server.common.generation import SAMPLING_FIELDS, UNSUPPORTED, Generation, begin, finish

MAX_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
FIELDS = SAMPLING_FIELDS | {"prompt", "max_tokens", "logprobs", "echo", "response_format"}
# Tools are the chat route's; this route takes only their neutral values, as it always did.
COMPLETION_UNSUPPORTED = {
    **UNSUPPORTED,
    "tools": ("tools need /v1/chat/completions", ([],)),
    "tool_choice": ("tools need /v1/chat/completions", ("none",)),
    "parallel_tool_calls": ("tools need /v1/chat/completions", (True, False)),
    "reasoning_effort": ("reasoning controls need /v1/chat/completions", ()),
}


def parse(body: Any, served_model: str) -> Generation:
    """Check a completions body; raise ``ApiError`` naming the first bad field."""
    gen = begin(body, chat=False, served_model=served_model, allowed=FIELDS, unsupported=COMPLETION_UNSUPPORTED)
    gen.prompts = prompts(body.get("prompt"))
    max_tokens = integer(body, "max_tokens", DEFAULT_MAX_TOKENS)
    gen.echo = flag(body, "echo")
    top_n = integer(body, "logprobs", None)
    if top_n is not None and not 0 <= top_n <= MAX_LOGPROBS:
        raise bad("logprobs", f"`logprobs` must lie in [0, {MAX_LOGPROBS}], got {top_n}")
    gen.logprobs = top_n is not None
    # Only completions can ask for no tokens: the prompt, scored (echo).
    return finish(gen, body, RANGES["max_tokens"], top_n, max_tokens)
