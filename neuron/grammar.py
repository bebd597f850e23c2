"""Output constraints: a JSON schema compiled into a grammar, and the matcher that follows one sequence. No MLX.

The engine compiles (``Grammars.compile``, on a thread, off the event loop and
off the step loop) when a request arrives, so a schema the grammar engine
cannot handle is refused with a 400 before anything is queued. The compiled
``Constraint`` rides to rank 0 inside the sequence's ``SamplingParams``; rank 0's
sampler asks it for each step's token mask and tells it each sampled token.
Workers never see it: only rank 0 samples.

Why llguidance: no dependencies (xgrammar pulls in torch and triton), an
Earley parser that takes recursive ``$ref`` as it is, resource limits on every
compile and every mask (``LIMITS``), and errors that name the keyword it does
not implement. Its mask costs about 12 µs per token on SmolLM2's 49k
vocabulary (xgrammar's about 2 µs): both are noise against a 60-90 ms step.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a type of the stubs only

# llguidance's own defaults, said out loud: each bounds the time or memory a hostile schema can cost.
LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2000,  # alternatives in one rule (a huge enum)
    initial_lexer_fuel=1_000_000,  # building the lexer: about 20 ms of work
    step_lexer_fuel=200_000,  # one mask: about 15 ms at worst
    step_max_items=50_000,
    max_lexer_states=250_000,  # about 1-2 kB each
    max_grammar_size=500_000,
    verbose_errors=False,  # the error goes back to the client: no grammar dump in it
)
# No free whitespace: a free-running model otherwise pads JSON with newlines until max_tokens.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


MAX_DEPTH = 64  # levels of JSON in a schema; llguidance's own parser stops at 128
# Distinct `$ref` values in a schema. llguidance compiles a `$ref` target once, recursing on the native stack
# through each target it has not compiled yet, so it recurses at most about MAX_REFS x MAX_DEPTH levels, and the
# compile runs on a thread whose stack holds many times that: a chain of a few thousand `$defs` faulted the
# process on an 8 MiB stack.
MAX_REFS = 256
COMPILE_STACK_BYTES = 512 << 20  # address space only: the pages a compile does not touch are never backed
VALUES = frozenset({"const", "enum", "default", "examples"})  # keywords whose values are data, not schemas


_STACK_SIZE = threading.Lock()  # threading.stack_size is process-wide: one compile sets and restores it at a time


class GrammarError(ValueError):
    """A schema that cannot be enforced; the message says which part."""


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``additionalProperties: false`` wherever an object names its properties and says nothing.

    What comes out still matches the schema as sent; but a small model left free
    to add properties keeps inventing them until max_tokens. Walked with a stack,
    and refused past ``MAX_DEPTH``: a 4 MiB body can nest deeper than Python recurses.
    """
    stack: list[tuple[Any, int]] = [(schema, 0)]
    refs: set[str] = set()
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise GrammarError(f"the schema nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict) and isinstance(ref := node.get("$ref"), str):
            refs.add(ref)
            if len(refs) > MAX_REFS:
                raise GrammarError(f"the schema refers (`$ref`) to more than {MAX_REFS} different places")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    out = json.loads(json.dumps(schema))
    stack = [(out, 0)]
    while stack:
        node, _ = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            stack.extend((child, 0) for key, child in node.items() if key not in VALUES)
        elif isinstance(node, list):
            stack.extend((child, 0) for child in node)
    return out


# How a refusal starts when llguidance's parser gave up for a schema's size, not for the model's token: a schema
# of many alternatives or links can outgrow the parser's row limit only as the text grows, past any check at compile
# time. The client can act on it (a simpler schema), so it is answered as the request's fault (server.common.errors).
TOO_COMPLEX = (
    "the schema is too complex for the output constraint's parser here; simplify it (fewer alternatives, less "
    "nesting or fewer $ref links)"
)


def _why(error: str, what: str) -> str:
    if error.startswith("Parser Error") and "max is" in error:
        return f"{TOO_COMPLEX}: {error}"
    return f"{what}: {error}"


class Constraint:
    """One sequence's place in its grammar: which tokens may come next, and whether the last one fit."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # one bit per token, in int32 words

    def fill(self, bitmask: np.ndarray) -> str | None:
        """Write the allowed next tokens into ``bitmask`` (one int32 row); return why none is allowed, if so."""
        self._matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        if self._matcher.is_error():
            return _why(self._matcher.get_error(), "the output constraint failed")
        if not bitmask.any():
            return "the output constraint reached a dead end: no token can continue it"
        return None

    def rewind(self, tokens: list[int]) -> None:
        """Start over and follow ``tokens``: where it stands after them, whatever it followed since."""
        self._matcher.reset()
        if tokens and not self._matcher.consume_tokens(tokens):
            raise ValueError(f"the output constraint refuses tokens it accepted before: {self._matcher.get_error()}")

    def advance(self, token: int) -> str | None:
        """Follow a sampled token; return why it does not fit, if it does not."""
        if self._matcher.consume_token(token):
            return None
        return _why(self._matcher.get_error(), f"the output constraint refused token {token}")


class Grammars:
    """Compiles JSON schemas for one tokenizer."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance.hf  # imports transformers: only where a tokenizer is at hand

        # Done once, when the model loads: it reads the whole vocabulary (BENCHMARKS.md, "llguidance's tokenizer").
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)
        self.vocab_size = vocab_size

    def compile(
        self, schema: dict[str, Any], around: Callable[[dict[str, Any], dict[str, Any]], str] | None = None
    ) -> Constraint:
        """A fresh constraint for ``schema``; ``GrammarError`` naming what cannot be enforced. ``around`` builds a
        lark grammar that holds the schema (given it and the JSON options): a thinking section before it.

        On a thread of its own with a large stack (see ``MAX_REFS``); the caller's thread waits for it.
        """
        outcome: list[Constraint | Exception] = []

        def run() -> None:
            try:
                outcome.append(self._compile(schema, around))
            except Exception as e:  # noqa: BLE001 - handed to the caller's thread, which raises it
                outcome.append(e)

        with _STACK_SIZE:
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
                thread.start()
            finally:
                threading.stack_size(previous)
        thread.join()
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    def _compile(
        self, schema: dict[str, Any], around: Callable[[dict[str, Any], dict[str, Any]], str] | None
    ) -> Constraint:
        schema = closed(schema)
        try:
            if around is not None:
                grammar = llguidance.grammar_from("lark", around(schema, dict(JSON_OPTIONS)))
            else:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(str(e)) from e
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer, limits=LIMITS)
        if failed:
            raise GrammarError(messages[0])
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        constraint = Constraint(matcher, self.vocab_size)
        # The first mask, here rather than in a step: a schema that admits no first token (``$ref`` loops with
        # nothing under them) is a 400, not a failed request. Computing a mask does not move the matcher.
        if (error := constraint.fill(np.zeros(constraint.words, dtype=np.int32))) is not None:
            raise GrammarError(f"no JSON value can begin to match it (a `$ref` loop with nothing under it?): {error}")
        return constraint
