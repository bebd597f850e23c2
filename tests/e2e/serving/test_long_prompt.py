"""Long prompts don't stall other streams (issue 46): while a prompt of the whole context prefills, three decoding
streams keep getting tokens within ``--itl-target-ms``, because each step feeds only as many prompt tokens beside
every running stream's next token as the target leaves room for; and a prompt longer than ``--max-context`` is
refused before any work is done.

One server for the module: the tiny qwen3 with a context twice the server's ``--max-context``, and a
``--prefill-chunk`` past the whole prompt, so that the target alone keeps the chunks small: fed whole, the prompt
stalls the streams for one long step (several seconds on the 2-core development box, more under load).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from testkit import Server, make_tiny_model, serving
from testkit.streams import measure

CONTEXT = 2048  # --max-context
TARGET_MS = 200  # --itl-target-ms
MARGIN = 3  # a loaded machine's late steps and arrivals: other processes take the cores between them
LONG = [(7 * i) % 200 + 40 for i in range(CONTEXT - 1)]  # the longest prompt the context takes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_tiny_model(tmp_path_factory.mktemp("long") / "qwen3", "qwen3", seed=11)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2 * CONTEXT}))
    chunking = ("--prefill-chunk", str(2 * CONTEXT), "--itl-target-ms", str(TARGET_MS))
    args = ("--max-context", str(CONTEXT), *chunking, "--prefix-cache-bytes", "0")
    with serving(tmp_path_factory, "--model", str(model), *args) as server:
        yield server


def test_decoding_streams_keep_within_the_itl_target_while_the_whole_context_prefills(server: Server) -> None:
    window = measure(server.url, "qwen3", streams=3, long_prompt=LONG)
    got = [s.between(window.start, window.end) for s in window.streams]
    # Each stream's mean gap while the prompt is fed: a prompt fed whole leaves each one token in the window, one
    # gap as long as the prefill. The mean, not a high percentile: a loaded machine stalls the odd step for a
    # second or more (other processes take the cores), which no chunk size prevents.
    pace = 1000 * (window.end - window.start) / max(1, min(got))
    gaps = sorted(round(1000 * gap) for gap in window.gaps())
    assert pace <= MARGIN * TARGET_MS, f"a token every {pace:.0f} ms (tokens each: {got}); gaps: {gaps}"


@pytest.mark.parametrize("tokens", [CONTEXT, CONTEXT + 1])
def test_a_prompt_the_context_cannot_hold_is_refused_before_any_work(server: Server, tokens: int) -> None:
    def work() -> tuple[float, float]:
        metrics = server.metrics()
        return metrics[("neuron_prompt_tokens_total", ())], metrics[("neuron_prefill_tokens_total", ())]

    before = work()
    body = {"model": "qwen3", "prompt": [40] * tokens, "max_tokens": 1}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and f"the context holds {CONTEXT}" in error["message"]
    assert work() == before  # nothing admitted, nothing fed
