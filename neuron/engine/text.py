"""Text in and out of the engine: the tokenizer and the chat template going in, detokenizing and stop strings
coming out.

mlx-lm's tokenizer wrapper does the work (its streaming detokenizers release
text only once a character is complete); this module adds what a server needs
around it: refusals that name the field, and stop strings never emitted, even
split across tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, StreamingDetokenizer, TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from neuron import images
from neuron.engine.image_prompts import Vision
from neuron.engine.refusals import RequestError
from neuron.engine.sequence import Sequence


class Text:
    def __init__(self, tokenizer: TokenizerWrapper, model_name: str, vision: Vision | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vision = vision  # a vision-language model's processor; None: images are refused
        # What skip_special_tokens leaves out of the text, as vLLM's detokenizer does.
        self.special_ids = frozenset(tokenizer._tokenizer.all_special_ids)

    @classmethod
    def load(cls, model_path: Path) -> Text:
        # Said out loud: a tokenizer_config.json's auto_map must never import a .py from the model folder.
        tokenizer = load_tokenizer(model_path, {"trust_remote_code": False})
        return cls(tokenizer, model_path.name, Vision.load(model_path) if model_path.is_dir() else None)

    def differs(self, other: Text) -> str | None:
        """How ``other``'s tokenizer reads text differently from this one, or None where the two map every token
        to the same id (a draft model's must: its tokens are verified as the model's)."""
        mine, theirs = self.tokenizer._tokenizer.get_vocab(), other.tokenizer._tokenizer.get_vocab()
        if mine == theirs:
            return None
        for token in sorted(mine.keys() ^ theirs.keys())[:1]:
            where, which = ("the model's", "the draft's") if token in mine else ("the draft's", "the model's")
            return f"token {token!r} is in {where} vocabulary but not in {which} ({len(mine)} and {len(theirs)} tokens)"
        token = next(t for t in sorted(mine) if mine[t] != theirs[t])
        return f"token {token!r} has id {mine[token]} in the model's vocabulary but {theirs[token]} in the draft's"

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    @property
    def tool_markup(self) -> tuple[str, str, Callable[[str, Any], Any]] | None:
        """How this model family writes a tool call (start marker, end marker, mlx-lm's parser), where its chat
        template shows it a request's tools (reads the ``tools`` variable) and mlx-lm knows the family's format;
        None where neuron shows the model its tools instead."""
        t = self.tokenizer
        template = t.chat_template
        if not (isinstance(template, str) and "tools" in template and t.has_tool_calling):
            return None
        return t.tool_call_start, t.tool_call_end or "", t.tool_parser

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not self.tokenizer.chat_template:
            raise RequestError(f"{self.model_name} has no chat template; use completions instead", "messages")
        extra = {"tools": tools} if tools else {}
        if images.image_parts(messages) and self.vision is None:
            raise RequestError(
                f"{self.model_name} reads text only: remove the image parts, or serve a vision-language model",
                images.first_image(messages),
            )
        try:
            if pictures := images.pictures(messages):
                assert self.vision is not None
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
                return self.vision.encode(text, pictures)
            tokens = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise RequestError(f"the model's chat template rejected the messages: {e}", "messages") from e
        return list(tokens)

    def start(self, seq: Sequence) -> None:
        """Give ``seq`` a detokenizer of its own."""
        detokenizer: StreamingDetokenizer = self.tokenizer.detokenizer
        if isinstance(detokenizer, BPEStreamingDetokenizer):
            # mlx-lm drops the first token's leading space; a completion continues its
            # prompt, so the text must be exactly what the tokens decode to.
            detokenizer._maybe_trim_space = lambda text: text  # type: ignore[method-assign]
        seq.detokenizer = detokenizer

    def push(self, seq: Sequence, token: int, produced: int) -> tuple[str, bool]:
        """Add a generated token, ``seq``'s ``produced``-th; return the text it releases and whether a stop string
        was reached."""
        armed = produced >= seq.params.min_tokens  # vLLM: no stop string ends it before min_tokens
        if seq.params.skip_special_tokens and token in self.special_ids:
            return seq.stop.push("", armed)
        seq.detokenizer.add_token(token)
        return seq.stop.push(seq.detokenizer.last_segment, armed)

    def finish(self, seq: Sequence) -> tuple[str, bool]:
        """Release what was held back (a partial character, a possible stop string's start) at the end."""
        seq.detokenizer.finalize()
        tail, stopped = seq.stop.push(seq.detokenizer.last_segment)
        return (tail, True) if stopped else (tail + seq.stop.flush(), False)
