"""Agent sessions replayed against a real ``neuron serve``: a system prompt, tool definitions, and a history of
tool calls, results and replies that grows by one request each turn, as coding agents send them; in OpenAI's Chat
form and Anthropic's Messages form, with a template that writes the date into the system prompt, and with thinking
that later turns drop. Shared by tests/e2e/caching/test_agent_sessions.py and bench/agents.py.

Each turn's replies are the server's own (a forced tool call, or a short text), sent back as an agent sends them.
What counts as reusable: the longest beginning a turn's prompt shares, token for token, with any sequence the
server computed for this session before (an earlier prompt followed by the tokens it generated), less the last
token, which is always fed. The prompt's tokens come from the server's ``/tokenize`` (the same template, the same
tools); a mismatch with the usage's count fails the replay, so the measure cannot silently drift from the prompt.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from testkit.models import SPECIALS, TOOLS_TEMPLATE, make_tiny_model

THINK = ("<think>", "</think>")
THINK_END = len(SPECIALS) + 256 + 1  # the thinking model's ``</think>``, added after the bytes and ``<think>``

# TOOLS_TEMPLATE, with a date in the system header (as Llama 3's templates write one: ``date_string``, or today).
AGENT_TEMPLATE = (
    '<|im_start|>system\nToday Date: {{ date_string if date_string is defined else strftime_now("%d %b %Y") }}'
    "<|im_end|>\n" + TOOLS_TEMPLATE
)
# And a thinking model's: the generation prompt opens a thinking section, or closes an empty one when
# ``enable_thinking`` is false; earlier turns are written without their thinking (as Qwen3's template does).
THINKING_TEMPLATE = AGENT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}",
)

SYSTEM = (
    "You are a coding agent working in a Python repository. Read before you edit, keep changes small, run the "
    "tests you touch, and explain each change in one sentence. "
) * 8
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"path": {"enum": ["src/parse.py", "tests/", "tests/test_parse.py"]}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    }
    for name, description in (
        ("read_file", "Read a file of the repository and return its text, numbered by line."),
        ("list_dir", "List the entries of a folder of the repository, folders first."),
        ("run_tests", "Run the tests of one file with pytest and return the summary and the failures."),
    )
]
# What the session does, turn by turn: a user message opens a task; each tool turn is a forced call whose result
# is sent back; each reply turn is a short text.
SCRIPT = [
    ("user", "The test for the parser fails on empty input. Find out why."),
    ("read_file", ""),
    ("list_dir", ""),
    ("reply", ""),
    ("user", "Good. Now fix it and run the tests."),
    ("run_tests", ""),
    ("read_file", ""),
    ("reply", ""),
]
# A reply turn's text: constrained, so that a random model's reply is text (not stray bytes) and ends by itself.
REPLY = {
    "type": "object",
    "properties": {
        "status": {
            "enum": [
                "The parser splits on whitespace before it checks for empty input, so an empty string reaches the "
                "tokenizer and raises there. I will move the check to the top of parse() and add a test for it.",
                "I moved the empty-input check to the top of parse(), added a test that parses an empty string and "
                "expects ValueError, and ran the parser's tests: all of them pass now.",
            ]
        }
    },
    "required": ["status"],
    "additionalProperties": False,
}
RESULT = "def parse(text):\n    if not text:\n        raise ValueError('empty')\n    return text.split()\n" * 2


def make_agent_model(folder: Path, thinking: bool = False, context: int = 8192) -> Path:
    """The tiny qwen3 with AGENT_TEMPLATE (``thinking``: with thinking markers and THINKING_TEMPLATE), and room
    for an agent's context."""
    from tokenizers import AddedToken, Tokenizer

    make_tiny_model(folder, "qwen3", seed=5, vocab=len(SPECIALS) + 256 + 8)
    if thinking:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
        tokenizer.save(str(folder / "tokenizer.json"))
    for name, changes in (
        ("tokenizer_config.json", {"chat_template": THINKING_TEMPLATE if thinking else AGENT_TEMPLATE}),
        ("config.json", {"max_position_embeddings": context}),
    ):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, **changes}))
    return folder


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    reusable: int  # of the prompt: what a cache of everything computed before could serve
    seconds: float  # to the whole reply
    first: float  # to the first generated token's event (streamed sessions); the whole reply otherwise


@dataclass
class Session:
    """One agent's session: its history, in OpenAI's Chat form (what the template renders) and in the API's own."""

    api: str  # "openai" or "anthropic"
    model: str
    dates: list[str] = field(default_factory=list)  # one per turn: the template's date; empty: the server's today
    thinking: bool = False
    stream: bool = False  # requests streamed, so that each turn's time to its first token is measured
    reply: dict[str, Any] = field(default_factory=lambda: REPLY)  # the schema a reply turn's text follows
    think_bias: float = 8.0  # added to ``</think>``'s logit in a thinking turn: the higher, the shorter the thinking
    chat: list[dict[str, Any]] = field(default_factory=lambda: [{"role": "system", "content": SYSTEM}])
    messages: list[dict[str, Any]] = field(default_factory=list)  # Anthropic's form (the system apart)
    computed: list[list[int]] = field(default_factory=list)  # each earlier prompt, followed by what it generated
    turns: list[Turn] = field(default_factory=list)

    def thinks(self, turn: int) -> bool:
        """Whether the turn thinks: a reply turn does (a random model's thinking might not end before a call)."""
        return self.thinking and SCRIPT[turn % len(SCRIPT)][0] in ("user", "reply")

    def template_kwargs(self, turn: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"enable_thinking": self.thinks(turn)} if self.thinking else {}
        if self.dates:
            kwargs["date_string"] = self.dates[turn % len(self.dates)]
        return kwargs


def replay(url: str, session: Session, turns: int = len(SCRIPT)) -> Session:
    """Run ``turns`` turns of SCRIPT (round and round) as ``session``; returns it with its turns measured."""
    with httpx.Client(base_url=url, timeout=300) as http:
        for i in range(turns):
            kind, text = SCRIPT[i % len(SCRIPT)]
            if kind == "user":
                _user(session, text)
            prompt = _tokenize(http, session, i)
            started = time.perf_counter()
            call = None if kind in ("user", "reply") else kind
            clock = _Clock(started)
            usage, generated = (_openai if session.api == "openai" else _anthropic)(url, session, call, i, clock)
            seconds = time.perf_counter() - started
            if usage[0] != len(prompt):
                raise AssertionError(f"turn {i}: /tokenize gave {len(prompt)} tokens, the request {usage[0]}")
            reusable = max((_common(prompt, seen) for seen in session.computed), default=0)
            first = clock.first if clock.first is not None else seconds
            session.turns.append(Turn(usage[0], usage[1], min(reusable, len(prompt) - 1), seconds, first))
            session.computed.append(prompt + _encode(http, session, generated))
            if call is not None:
                _result(session, RESULT)
    return session


def share(sessions: list[Session]) -> float:
    """Of the prompt tokens reusable from the second turn on, the share served from the cache (1.0: none were)."""
    later = [turn for s in sessions for turn in s.turns[1:]]
    reusable = sum(t.reusable for t in later)
    return sum(min(t.cached_tokens, t.reusable) for t in later) / reusable if reusable else 1.0


class _Clock:
    """When a streamed reply's first generated token arrived, in seconds since ``started``."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first: float | None = None

    def tick(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.started


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _user(session: Session, text: str) -> None:
    session.chat.append({"role": "user", "content": text})
    session.messages.append({"role": "user", "content": [{"type": "text", "text": text}]})


def _result(session: Session, text: str) -> None:
    call_id = session.chat[-1]["tool_calls"][0]["id"]
    session.chat.append({"role": "tool", "tool_call_id": call_id, "content": text})
    block = {"type": "tool_result", "tool_use_id": call_id, "content": text}
    session.messages.append({"role": "user", "content": [block]})


def _tokenize(http: httpx.Client, session: Session, turn: int) -> list[int]:
    body = {
        "model": session.model,
        "messages": session.chat,
        "tools": TOOLS,
        "chat_template_kwargs": session.template_kwargs(turn),
    }
    reply = http.post("/tokenize", json=body)
    reply.raise_for_status()
    return list(reply.json()["tokens"])


def _encode(http: httpx.Client, session: Session, text: str) -> list[int]:
    reply = http.post("/tokenize", json={"model": session.model, "prompt": text, "add_special_tokens": False})
    reply.raise_for_status()
    return list(reply.json()["tokens"])


def _openai(url: str, session: Session, call: str | None, turn: int, clock: _Clock) -> tuple[tuple[int, int], str]:
    """One Chat request; (prompt, cached) tokens and the text the model generated. The reply joins the history."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    choice = {"type": "function", "function": {"name": call}} if call else "auto"
    reply_format = {"type": "json_schema", "json_schema": {"name": "reply", "schema": session.reply}}
    request: dict[str, Any] = dict(
        model=session.model,
        messages=session.chat,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=200,
        response_format=openai.NOT_GIVEN if call else reply_format,
        logit_bias={str(THINK_END): session.think_bias} if session.thinks(turn) else openai.NOT_GIVEN,
        temperature=0.0,
        extra_body={"chat_template_kwargs": session.template_kwargs(turn)},
    )
    if session.stream:
        usage, content, thinking, calls = _openai_streamed(client, request, clock)
    else:
        reply = client.chat.completions.create(**request)
        message = reply.choices[0].message
        usage, content = reply.usage, message.content or ""
        thinking = getattr(message, "reasoning_content", None) or ""
        calls = [
            {"id": c.id, "type": "function", "function": c.function.model_dump()} for c in message.tool_calls or []
        ]
    assert usage is not None and usage.prompt_tokens_details is not None
    counts = (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0)
    if call:
        assert calls, f"turn {turn}: the forced call to {call} did not come: {content!r}"
        session.chat.append({"role": "assistant", "content": "", "tool_calls": calls[:1]})
        return counts, calls[0]["function"]["arguments"]
    session.chat.append({"role": "assistant", "content": content})
    return counts, (thinking + THINK[1] if session.thinks(turn) else "") + content


def _openai_streamed(
    client: openai.OpenAI, request: dict[str, Any], clock: _Clock
) -> tuple[Any, str, str, list[dict[str, Any]]]:
    """A streamed Chat request's usage, text, thinking and tool calls, put back together from its chunks."""
    content, thinking = [], []
    calls: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning = getattr(delta, "reasoning_content", None)
            if delta.content or reasoning or delta.tool_calls:
                clock.tick()
            content.append(delta.content or "")
            thinking.append(reasoning or "")
            for part in delta.tool_calls or []:
                entry = calls.setdefault(
                    part.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                entry["id"] = part.id or entry["id"]
                if part.function is not None:
                    entry["function"]["name"] += part.function.name or ""
                    entry["function"]["arguments"] += part.function.arguments or ""
    return usage, "".join(content), "".join(thinking), [calls[i] for i in sorted(calls)]


def _anthropic(url: str, session: Session, call: str | None, turn: int, clock: _Clock) -> tuple[tuple[int, int], str]:
    """One Messages request; as ``_openai``, in Anthropic's form (thinking blocks are sent back, as clients do)."""
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    tools = [
        {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
        for f in (t["function"] for t in TOOLS)
    ]
    reply_format = {"type": "json_schema", "schema": session.reply}
    if session.dates:
        raise ValueError("Messages requests set no template variables: replay dated sessions in the OpenAI form")
    request: dict[str, Any] = dict(
        model=session.model,
        system=SYSTEM,
        messages=session.messages,
        tools=tools,
        tool_choice={"type": "tool", "name": call} if call else {"type": "auto"},
        max_tokens=200,
        thinking={"type": "enabled", "budget_tokens": 1024} if session.thinks(turn) else {"type": "disabled"},
        extra_body={"temperature": 0.0, **({} if call else {"output_config": {"format": reply_format}})},
    )
    if session.stream:
        with client.messages.stream(**request) as events:
            for event in events:
                if event.type in ("content_block_start", "content_block_delta"):
                    clock.tick()
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**request)
    usage = reply.usage
    counts = (usage.input_tokens + (usage.cache_read_input_tokens or 0), usage.cache_read_input_tokens or 0)
    blocks = [block.model_dump(exclude_none=True) for block in reply.content]
    session.messages.append({"role": "assistant", "content": blocks})
    uses = [b for b in blocks if b["type"] == "tool_use"]
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    thinking = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    if call:
        assert uses, f"turn {turn}: the forced call to {call} did not come"
        arguments = json.dumps(uses[0]["input"])
        entry = {"id": uses[0]["id"], "type": "function", "function": {"name": uses[0]["name"], "arguments": arguments}}
        session.chat.append({"role": "assistant", "content": text, "tool_calls": [entry]})
        return counts, arguments
    session.chat.append({"role": "assistant", "content": text})
    return counts, (thinking + THINK[1] if session.thinks(turn) else "") + text
