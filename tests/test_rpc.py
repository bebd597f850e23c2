"""The codec: every message round-trips, and every kind of malformed line is refused by name."""

from __future__ import annotations

import json

import pytest

from neuron import rpc
from neuron.rpc import ErrorKind

EVERY_MESSAGE = [
    rpc.Ping(id=1),
    rpc.Init(id=2, backend="ring", env={"MLX_RANK": "1", "MLX_HOSTFILE": "/tmp/h.json"}),
    rpc.LoadShard(id=3, model_path="/models/x"),
    rpc.StepPlan(leave=[3], prefill=[(5, 0, [1, 2, 3], True), (6, 4, [9], False)], decode=[(1, 7), (2, 8)]).request(4),
    rpc.ClearKvCache(id=5),
    rpc.Unload(id=6),
    rpc.Shutdown(id=7),
    rpc.Pong(id=1, rank=1, world_size=2, protocol=rpc.PROTOCOL_VERSION, pid=1234),
    rpc.InitOk(id=2, all_sum=2.0),
    rpc.LoadShardOk(id=3, parameters=1000, seconds=0.5),
    rpc.GenerateStepOk(id=4, fingerprint="0123abcd"),
    rpc.KvCacheCleared(id=5),
    rpc.Unloaded(id=6),
    rpc.Bye(id=7),
    rpc.Error(id=None, kind="invalid_json", message="bad"),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: m.op)
def test_round_trip(message: rpc.Request | rpc.Reply) -> None:
    line = rpc.encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    decode = rpc.decode_request if isinstance(message, rpc.REQUESTS) else rpc.decode_reply
    assert decode(line) == message


def test_every_op_is_covered() -> None:
    assert {type(m) for m in EVERY_MESSAGE} == set(rpc.REQUESTS) | set(rpc.REPLIES)


def _step_line(**fields: object) -> bytes:
    """A generate_step line, well formed but for ``fields``."""
    step = {"op": "generate_step", "id": 4, "leave": [], "prefill_seqs": [], "prefill_tokens": [], "prefill_last": []}
    step["prefill_positions"] = []
    return json.dumps({**step, "decode_seqs": [1], "decode_tokens": [1], **fields}).encode()


MALFORMED = [
    (b"{not json", ErrorKind.INVALID_JSON, None),
    (b"\xff\xfe garbage", ErrorKind.INVALID_JSON, None),
    (b"[1, 2]", ErrorKind.INVALID_JSON, None),
    (b"", ErrorKind.INVALID_JSON, None),
    (b'{"op": "fly", "id": 3}', ErrorKind.UNKNOWN_OP, 3),
    (b'{"id": 3}', ErrorKind.UNKNOWN_OP, 3),
    (b'{"op": "pong", "id": 3}', ErrorKind.UNKNOWN_OP, 3),  # a reply is not a request
    (b'{"op": "generate_step", "id": 4, "decode_tokens": [1]}', ErrorKind.INVALID_FIELD, 4),
    (_step_line(decode_tokens=["2"]), ErrorKind.INVALID_FIELD, 4),
    (_step_line(decode_tokens=[True]), ErrorKind.INVALID_FIELD, 4),
    (_step_line(prefill_tokens=[[1.5]]), ErrorKind.INVALID_FIELD, 4),
    (b'{"op": "ping", "id": 5, "extra": 1}', ErrorKind.INVALID_FIELD, 5),
    (b'{"op": "ping", "id": "5"}', ErrorKind.INVALID_FIELD, None),
    (b'{"op": "init", "id": 6, "backend": "ring", "env": {"A": 1}}', ErrorKind.INVALID_FIELD, 6),
    (b"{" + b'"op": "ping", "pad": "' + b"x" * rpc.MAX_LINE_BYTES + b'"}', ErrorKind.LINE_TOO_LONG, None),
]


@pytest.mark.parametrize(("line", "kind", "request_id"), MALFORMED)
def test_malformed_lines_are_refused_by_kind(line: bytes, kind: ErrorKind, request_id: int | None) -> None:
    with pytest.raises(rpc.ProtocolError) as caught:
        rpc.decode_request(line)
    assert caught.value.kind == kind
    assert caught.value.request_id == request_id


def test_field_errors_name_every_field() -> None:
    with pytest.raises(rpc.ProtocolError) as caught:
        rpc.decode_request(b'{"op": "generate_step", "id": 1, "decode_tokens": "abc", "bogus": 0}')
    message = caught.value.message
    assert "'decode_tokens' must be list[int]" in message
    assert "missing field 'leave'" in message
    assert "unknown field 'bogus'" in message


def test_protocol_module_does_not_import_mlx() -> None:
    import subprocess
    import sys

    code = "import sys, neuron.rpc; sys.exit(any(m.startswith('mlx') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
