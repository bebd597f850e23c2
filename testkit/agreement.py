"""How close a served model's greedy choices stay to another server's (``--kv-bits`` against unquantized): shared
by tests/e2e/caching/test_kv_bits.py and bench/kv_bits.py.

Teacher-forced (``agreement``): the reference server answers each question greedily, and both servers then score
that same history (``echo`` with ``logprobs``); agreement is the share of the answer's positions where both rank the
same token first. Free-running (``free_running``), each server answering on its own, lets one early near tie decide
every token after it: the share of each answer before its first difference.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from testkit.server import Server

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a binary search does.",
    "List three uses for a paper clip.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
]
TOKENS = 64  # answer tokens compared per question


def _post(server: Server, path: str, body: dict) -> dict:
    model = httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"][0]["id"]  # the one served
    reply = httpx.post(f"{server.url}{path}", json={"model": model, **body}, timeout=600)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _answer(server: Server, prompt: list[int], tokens: int) -> list[int]:
    """``server``'s greedy answer of ``tokens`` tokens (past its end of sequence) to ``prompt``, in token ids."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    answer = _post(server, "/v1/completions", body)["choices"][0]["text"]
    return list(_post(server, "/tokenize", {"prompt": answer, "add_special_tokens": False})["tokens"][:tokens])


def _prompt(server: Server, question: str) -> list[int]:
    return list(_post(server, "/tokenize", {"messages": [{"role": "user", "content": question}]})["tokens"])


def histories(server: Server, questions: list[str], tokens: int = TOKENS) -> list[list[int]]:
    """Each question's chat prompt followed by ``server``'s greedy answer of ``tokens`` tokens, in token ids; the
    questions are asked together."""

    def one(question: str) -> list[int]:
        prompt = _prompt(server, question)
        return prompt + _answer(server, prompt, tokens)

    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(one, questions))


def free_running(other: Server, questions: list[str], every: list[list[int]], tokens: int = TOKENS) -> float:
    """The share of each of ``other``'s own greedy answers before it first differs from the reference's answer in
    ``every`` (``histories``), averaged; asked together, as ``histories`` asks."""

    def one(pair: tuple[str, list[int]]) -> float:
        prompt = _prompt(other, pair[0])
        want, got = pair[1][len(prompt) :], _answer(other, prompt, tokens)
        same = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
        return same / len(want)

    with ThreadPoolExecutor(len(questions)) as pool:
        shares = list(pool.map(one, zip(questions, every, strict=True)))
    return sum(shares) / len(shares)


def firsts(server: Server, history: list[int], tokens: int = TOKENS) -> list[str]:
    """The token ``server``'s model ranks first at each of the last ``tokens`` positions of ``history``."""
    body = {"prompt": history, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0.0}
    tops = _post(server, "/v1/completions", body)["choices"][0]["logprobs"]["top_logprobs"]
    return [max(top, key=top.get) for top in tops[-tokens:]]


def every_firsts(server: Server, every: list[list[int]], tokens: int = TOKENS) -> list[list[str]]:
    """``firsts`` of each history in ``every``, asked one at a time (one row: deterministic on the CPU)."""
    return [firsts(server, history, tokens) for history in every]


def share(wanted: list[list[str]], got: list[list[str]]) -> float:
    """The share of positions, over every history, where ``got`` ranks first what ``wanted`` does (both
    ``every_firsts``)."""
    same = total = 0
    for want, mine in zip(wanted, got, strict=True):
        same += sum(a == b for a, b in zip(want, mine, strict=True))
        total += len(want)
    return same / total


def agreement(
    reference: Server | list[list[str]], other: Server, every: list[list[int]], tokens: int = TOKENS
) -> float:
    """The share of positions, over every history, where ``other`` ranks first what ``reference`` does (a server,
    or its ``every_firsts``, computed once for several others)."""
    wanted = reference if isinstance(reference, list) else every_firsts(reference, every, tokens)
    return share(wanted, every_firsts(other, every, tokens))
