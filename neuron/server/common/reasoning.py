"""A thinking model's reasoning, kept apart from its answer: the request's controls read, the chat template given
them, the thinking section split out of the generated text, and the grammar that lets a schema constrain only
what follows it. No MLX.

mlx-lm finds a model's thinking markers (``TokenizerWrapper.think_start``/``think_end``: ``<think>``...``</think>``
for Qwen3, QwQ and DeepSeek-R1, and the other families it knows) and whether a prompt leaves the model inside a
thinking section (the last start marker after the last end marker: DeepSeek-R1's template opens it for the
model). Its own text splitter lives in ``mlx_lm.generate``, which loads MLX, so the few lines of splitting are
here, in the manner of ``tools.TextToolStream``: text released at once, a possible marker's beginning held back.

gpt-oss writes OpenAI's harmony format instead, which mlx-lm does not know: ``harmony`` renders and parses it
with OpenAI's library; its ``splitter`` gives gpt-oss a ``Reply`` in place of this module's ``ThinkingSplit``.

A model whose tokenizer has no thinking markers is unchanged: no splitter, no template argument added.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from neuron.engine.refusals import RequestError
from neuron.sampling_params import SamplingParams
from neuron.server.common.errors import bad

# The template variables neuron itself sets, and apply_chat_template's own arguments: a request may not set them
# through ``chat_template_kwargs``.
RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_TEMPLATE_KWARGS = 32
FIELDS = ("chat_template_kwargs", "include_reasoning", "reasoning_effort")
CLOSING_TAIL = 8  # tokens at the end of a prompt where a template's own closing of the section lies


@dataclass(frozen=True, slots=True)
class Thinking:
    """A model's thinking markers, as mlx-lm infers them from its vocabulary."""

    start: str
    end: str
    start_tokens: tuple[int, ...]
    end_tokens: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Any) -> Thinking | None:
        if not getattr(tokenizer, "has_thinking", False):
            return None
        start, end = tokenizer.think_start_tokens, tokenizer.think_end_tokens
        return cls(tokenizer.think_start, tokenizer.think_end, tuple(start), tuple(end))

    @property
    def single_tokens(self) -> bool:
        """Each marker one token: what the grammar below needs."""
        return len(self.start_tokens) == 1 and len(self.end_tokens) == 1


def inside(tokenizer: Any, prompt: list[int]) -> bool:
    """Whether ``prompt`` ends inside a thinking section (its template opened one for the model), as mlx-lm's
    server decides it."""
    return tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)


@dataclass(slots=True)
class Options:
    """The request's reasoning controls: vLLM's ``chat_template_kwargs`` and ``include_reasoning``, OpenAI's
    ``reasoning_effort``."""

    template_kwargs: dict[str, Any] = field(default_factory=dict)
    include: bool = True
    effort: str | None = None


def parse(body: dict[str, Any]) -> Options:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise bad("chat_template_kwargs", "`chat_template_kwargs` must be an object of template variables")
        if len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise bad("chat_template_kwargs", f"`chat_template_kwargs` holds at most {MAX_TEMPLATE_KWARGS} variables")
        if taken := sorted(RESERVED & kwargs.keys()):
            message = f"`chat_template_kwargs` may not set {', '.join(taken)}: neuron sets them from the request"
            raise bad("chat_template_kwargs", message)
    include = body.get("include_reasoning")
    if include is not None and type(include) is not bool:
        raise bad("include_reasoning", "`include_reasoning` must be a boolean", "invalid_type")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise bad("reasoning_effort", f"`reasoning_effort` must be one of {', '.join(EFFORTS)}, got {effort!r}")
    return Options(dict(kwargs or {}), include is not False, effort)


def template_kwargs(options: Options | None, template: Any, thinking: Thinking | None) -> dict[str, Any]:
    """What the chat template gets beyond messages and tools. ``reasoning_effort`` goes to a template that reads
    it (gpt-oss's); on another thinking model ``none`` turns thinking off and the other levels leave it on; a
    model that neither thinks nor reads it refuses it, as before, rather than ignore it."""
    if options is None:
        return {}
    out = dict(options.template_kwargs)
    if options.effort is not None:
        if isinstance(template, str) and "reasoning_effort" in template:
            out.setdefault("reasoning_effort", options.effort)
        elif thinking is not None:
            if options.effort == "none":
                out.setdefault("enable_thinking", False)
        else:
            message = "`reasoning_effort`: this model does not reason (its chat template has no thinking section)"
            raise bad("reasoning_effort", message, "unsupported_parameter")
    return out


def encode_chat(
    text: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
) -> list[int]:
    """``Text.encode_chat`` with the request's template variables; the same refusals."""
    if not kwargs:
        return text.encode_chat(messages, tools)
    if not text.tokenizer.chat_template:
        raise RequestError(f"{text.model_name} has no chat template; use completions instead", "messages")
    extra = {"tools": tools} if tools else {}
    try:
        tokens = text.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **extra, **kwargs
        )
    except Exception as e:  # a template raises what its author wrote (jinja2 exceptions, raise_exception)
        raise RequestError(f"the model's chat template rejected the messages: {e}", "chat_template_kwargs") from e
    return list(tokens)


class ReasoningSplit(Protocol):
    """What the reply routes read a reply through to keep its reasoning apart from its answer, whichever way the
    model marks it: ``ThinkingSplit`` at its thinking markers, ``harmony.Reply`` by harmony's channels."""

    tokens: int  # generated tokens that belong to the reasoning, its markers included

    def push(self, text: str, token: bool = True) -> tuple[str, str]:
        """Add one token's text (or, not ``token``, the text the end released); return the (reasoning, answer)
        text it releases."""

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply is done."""

    def end(self, text: str) -> tuple[str, str]:
        """The reply's last text (a ``Finish``'s) and what was held back, split."""

    def whole(self, texts: list[str], tail: str) -> tuple[str, str]:
        """A whole reply, one text per token then the last, split."""


def split_end(split: ReasoningSplit, text: str) -> tuple[str, str]:
    """``ReasoningSplit.end``, written once: the splits differ only in ``push`` and ``finish``."""
    reasoning, answer = split.push(text, token=False)
    held_reasoning, held_answer = split.finish()
    return reasoning + held_reasoning, answer + held_answer


def split_whole(split: ReasoningSplit, texts: list[str], tail: str) -> tuple[str, str]:
    """``ReasoningSplit.whole``, written once: the splits differ only in ``push`` and ``finish``."""
    parts = [split.push(text) for text in texts] + [split.end(tail)]
    return "".join(r for r, _ in parts), "".join(a for _, a in parts)


class ThinkingSplit:
    """A ``ReasoningSplit`` at a model's thinking markers (mlx-lm's ``Thinking``), the markers dropped."""

    def __init__(self, thinking: Thinking, inside: bool) -> None:
        self.thinking = thinking
        self.inside = inside  # within a thinking section now
        self.tokens = 0  # generated tokens that belong to the reasoning, its markers included
        self._pending = ""

    def push(self, text: str, token: bool = True) -> tuple[str, str]:
        was_inside = self.inside
        reasoning: list[str] = []
        answer: list[str] = []
        pending = self._pending + text
        while True:
            marker = self.thinking.end if self.inside else self.thinking.start
            out = reasoning if self.inside else answer
            if (at := pending.find(marker)) < 0:
                break
            out.append(pending[:at])
            pending = pending[at + len(marker) :]
            self.inside = not self.inside
        keep = next((k for k in range(min(len(marker) - 1, len(pending)), 0, -1) if pending.endswith(marker[:k])), 0)
        out.append(pending[: len(pending) - keep])
        self._pending = pending[len(pending) - keep :]
        if token and (was_inside or self.inside):
            self.tokens += 1
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        pending, self._pending = self._pending, ""
        return (pending, "") if self.inside else ("", pending)

    def end(self, text: str) -> tuple[str, str]:
        return split_end(self, text)

    def whole(self, texts: list[str], tail: str) -> tuple[str, str]:
        return split_whole(self, texts, tail)


def harmony(tokenizer: Any) -> bool:
    """Whether the model writes OpenAI's harmony format (gpt-oss): its vocabulary has the channel markers."""
    added = tokenizer.added_tokens_encoder  # the markers are added tokens; the whole vocabulary is slow to list
    return "<|channel|>" in added and "<|message|>" in added


def chat_params(tokenizer: Any, params: SamplingParams) -> SamplingParams:
    """A chat's sampling parameters for this model: a harmony reply keeps its markers in the text for
    ``harmony.Reply``, even where the tokenizer names them special (``skip_special_tokens`` would drop them)."""
    if not harmony(tokenizer):
        return params
    # gpt-oss ends its turn on <|call|> as well as <|return|> (its generation_config), which mlx-lm's eos omits.
    ends = [
        tokenizer.added_tokens_encoder[t] for t in ("<|call|>", "<|return|>") if t in tokenizer.added_tokens_encoder
    ]
    stops = tuple(dict.fromkeys((*params.stop_token_ids, *ends)))
    return dataclasses.replace(params, skip_special_tokens=False, stop_token_ids=stops)


def splitter(tokenizer: Any, prompt: list[int]) -> ReasoningSplit | None:
    thinking = Thinking.of(tokenizer)
    return ThinkingSplit(thinking, inside(tokenizer, prompt)) if thinking else None


def grammar(tokenizer: Any, prompt: list[int]) -> Callable[[dict[str, Any], dict[str, Any]], str] | None:
    """How a constraint's schema goes into a grammar for this prompt (``grammar.Grammars.compile``'s ``around``):
    after a thinking section, for a model whose markers are single tokens; None to constrain from the start,
    as for a prompt whose template closed the section for this turn (thinking turned off)."""
    thinking = Thinking.of(tokenizer)
    if thinking is None or not thinking.single_tokens or closed(tokenizer, prompt):
        return None
    return functools.partial(lark, thinking=thinking, opened=inside(tokenizer, prompt))


def closed(tokenizer: Any, prompt: list[int]) -> bool:
    """Whether the template closed a thinking section at the very end of ``prompt`` (Qwen3's
    ``<think>\n\n</think>\n\n`` when ``enable_thinking`` is false), rather than in an earlier turn."""
    return tokenizer.rfind_think_end(prompt, start=len(prompt) - CLOSING_TAIL) > tokenizer.rfind_think_start(prompt)


def lark(schema: dict[str, Any], options: dict[str, Any], *, thinking: Thinking, opened: bool) -> str:
    """A grammar for llguidance: a thinking section, free text up to its end marker, then the JSON ``schema``.
    ``opened``: the prompt already opened the section; otherwise it is optional, so a model told not to think
    answers at once. The markers are single tokens named by id (llguidance sees added tokens as special)."""
    schema = {**schema, "x-guidance": options}
    head = "think" if opened else f"(<[{thinking.start_tokens[0]}]> think)?"
    return "\n".join(
        (
            f"start: {head} GAP answer",
            f"think: THOUGHT <[{thinking.end_tokens[0]}]>",
            "THOUGHT: /(?s:.*)/",
            "GAP: /\\n{0,2}/",
            f"answer: %json {json.dumps(schema)}",
        )
    )


# The OpenAPI pieces of the reasoning controls, beside the checks they describe.

TEMPLATE_KWARGS = {
    "type": "object",
    "maxProperties": MAX_TEMPLATE_KWARGS,
    "propertyNames": {"not": {"enum": sorted(RESERVED)}},
    "description": "extra variables for the chat template (vLLM's), such as enable_thinking",
}


def request_properties(reasons: bool) -> dict[str, Any]:
    """``chat_template_kwargs``, ``include_reasoning``, and ``reasoning_effort`` where the model ``reasons``
    (thinks, or its template reads the effort)."""
    properties: dict[str, Any] = {
        "chat_template_kwargs": {"anyOf": [TEMPLATE_KWARGS, {"type": "null"}]},
        "include_reasoning": {
            "anyOf": [{"type": "boolean"}, {"type": "null"}],
            "description": "false leaves a thinking model's reasoning_content out (vLLM's)",
        },
    }
    if reasons:
        properties["reasoning_effort"] = {
            "enum": [*EFFORTS, None],
            "description": "to a template that reads it; otherwise none turns thinking off",
        }
    return properties


def reasons(tokenizer: Any) -> bool:
    """Whether ``reasoning_effort`` is taken: the model thinks, or its template reads the effort."""
    template = tokenizer.chat_template
    reads = isinstance(template, str) and "reasoning_effort" in template
    return Thinking.of(tokenizer) is not None or reads or harmony(tokenizer)
