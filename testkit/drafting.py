"""What the draft tests share: a greedy completion, the draft tokens its usage says were kept and thrown away, the
check that drafting changes no greedy output, alone or batched, and the bound a chi-square test of sampled output
holds to."""

from __future__ import annotations

import math

import anyio
import httpx

from testkit.closeness import TOP, Scored, assert_all_same
from testkit.server import Server


def complete(server: Server, model: str, prompt: str, max_tokens: int, **extra: object) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def spoken(replies: list[dict]) -> tuple[int, int]:
    """Draft tokens kept and thrown away, over the replies."""
    details = [r["usage"]["completion_tokens_details"] for r in replies]
    return sum(d["accepted_prediction_tokens"] for d in details), sum(d["rejected_prediction_tokens"] for d in details)


async def drafts_change_nothing(server: Server, model: str, prompts: list[str], max_tokens: list[int]) -> None:
    """Greedy completions with drafts, one at a time and all at once, equal those without (``num_draft_tokens``
    0 on the same server); some drafts were kept and some thrown away."""
    pairs = list(zip(prompts, max_tokens, strict=True))
    plain = [complete(server, model, p, n, num_draft_tokens=0, logprobs=TOP) for p, n in pairs]
    alone = [complete(server, model, p, n, logprobs=TOP) for p, n in pairs]
    together: list[dict] = [{}] * len(pairs)

    async def one(i: int) -> None:
        together[i] = await anyio.to_thread.run_sync(lambda: complete(server, model, *pairs[i], logprobs=TOP))

    async with anyio.create_task_group() as tg:
        for i in range(len(pairs)):
            tg.start_soon(one, i)
    scored = [[Scored.of(r["choices"][0]) for r in replies] for replies in (plain, alone, together)]
    assert_all_same(scored[0], scored[1], "drafted alone")
    assert_all_same(scored[0], scored[2], "drafted together")
    kept, thrown = spoken(alone + together)
    assert kept > 0 and thrown > 0, (kept, thrown)  # drafts were kept, and rejected ones rolled back
    assert spoken(plain) == (0, 0)


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square statistic a test at p = 0.001 rejects above (Wilson and Hilferty's approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
