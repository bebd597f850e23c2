"""A real worker's stdin fed arbitrary lines (hypothesis): one protocol reply per line, never a hang, never noise.

``init`` is left out of the generated requests: joining a group waits for
peers by design, and the leader bounds that wait with its init deadline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuron import rpc
from testkit.worker import WorkerProcess, spawned_worker

PING_ID = 424242

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(
    ["id", "leave", "prefill_seqs", "prefill_positions", "prefill_tokens", "prefill_last", "decode_seqs",
     "decode_tokens", "model_path", "backend", "env"]
)  # fmt: skip
requests = st.builds(
    lambda op, extra: json.dumps({"op": op, **extra}).encode(),
    st.sampled_from(["ping", "generate_step", "clear_kv_cache", "unload", "load_share", "teleport", "", "PING"]),
    st.dictionaries(fields, values, max_size=6),
)
raw = st.binary(max_size=200).map(lambda b: b.replace(b"\n", b" "))
lines = st.lists(raw | requests, min_size=1, max_size=4)


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with spawned_worker() as w:
        yield w


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=lines)
def test_every_line_gets_one_protocol_reply_and_the_worker_keeps_serving(
    worker: WorkerProcess, lines: list[bytes]
) -> None:
    for line in lines:
        worker.send(line + b"\n")
    worker.send(rpc.encode(rpc.Ping(id=PING_ID)))
    replies = [worker.reply(timeout=10) for _ in range(len(lines) + 1)]  # each decodes, or this fails
    *answers, pong = replies
    assert isinstance(pong, rpc.Pong) and pong.id == PING_ID, replies
    for line, answer in zip(lines, answers, strict=True):
        if not isinstance(answer, rpc.Error):
            # Only a well-formed request may succeed, and then only one that needs no model.
            assert isinstance(answer, (rpc.Pong, rpc.KvCacheCleared)), (line, answer)
        else:
            assert answer.message.startswith("rank 1:")
    assert worker.proc.poll() is None
