"""The codec: every message round-trips, and every kind of malformed line is refused by name."""

from __future__ import annotations

import json

import pytest

from neuron import rpc
from neuron.rpc import ErrorKind

HOST = rpc.HostInfo("mac2", "0.1.0", "0.32.4", "0.32.2", "3.11.7", "linux-x86_64", 8 << 30, 0, "", -1, [0, 1], 2)


EVERY_MESSAGE = [
    rpc.Ping(id=1),
    rpc.Listen(id=8, ips=["10.0.0.2"]),
    rpc.Probe(id=9, addresses=["10.0.0.3:4000"]),
    rpc.Init(
        id=2,
        backend="ring",
        env={"MLX_RANK": "1"},
        files={"MLX_HOSTFILE": '[["10.0.0.1:4000"], ["10.0.0.2:4001"]]'},
        settings=rpc.WorkerSettings(host="mac2", log_level="info", log_format="json", cpus=[2, 3]),
    ),
    rpc.CheckModel(id=10, model=None),
    rpc.CheckModel(id=11, model="/models/x", share="0123456789abcdef/tp-1-of-2"),
    rpc.CheckModel(id=14, model="org/x@main", weights=["model-00002-of-00003.safetensors"], token="hf_secret"),
    rpc.LoadShare(id=3, model_path="/models/x", layers=[0, 15]),
    rpc.LoadAdapter(id=12, adapter=1, name="sql", path="/adapters/sql"),
    rpc.UnloadAdapter(id=13, adapter=1),
    rpc.GenerateStep(
        id=4,
        plan=rpc.StepPlan(
            leave=[3],
            prefill=[rpc.Prefill(5, 0, [1, 2, 3], True), rpc.Prefill(6, 4, [9], False, adapter=2)],
            decode=[rpc.Decode(1, 7, 0), rpc.Decode(2, 8, 1, draft=[3, 4], drop=2, adapter=1)],
            restore=[rpc.Restore(6, 2, 4)],
            save=[rpc.Save(5, 3), rpc.Save(3, 4, tokens=9)],
            evict=[rpc.Evict(1), rpc.Evict(2, key="0123abcd")],
        ),
    ),
    rpc.ClearKvCache(id=5, prefixes=True),
    rpc.OpenPrefixDisk(id=12, folder="/var/cache/neuron/kv", budget=1 << 30, stamp="0123abcd/world 2/layers []"),
    rpc.LoadPrefixes(id=13, entries={"0123abcd": 1}),
    rpc.FlushPrefixDisk(id=14),
    rpc.ReadMemory(id=15),
    rpc.Shutdown(id=7),
    rpc.Pong(id=1, rank=1, world_size=2, protocol=rpc.PROTOCOL_VERSION, pid=1234, host=HOST),
    rpc.Listening(id=8, addresses=["10.0.0.2:4001"]),
    rpc.Probed(id=9, unreachable={"10.0.0.3:4000": "Connection refused"}),
    rpc.ModelChecked(id=10, path="/models/x", files={"config.json": "ab12"}),
    rpc.ModelChecked(id=11, path="/nowhere", files={}, share="/cache/shares/0123456789abcdef/tp-1-of-2"),
    rpc.InitOk(id=2, all_sum=2.0),
    rpc.LoadShareOk(id=3, parameters=1000, seconds=0.5),
    rpc.AdapterLoaded(id=12, projections=15),
    rpc.AdapterUnloaded(id=13),
    rpc.GenerateStepOk(id=4, fingerprint="0123abcd"),
    rpc.GenerateStepOk(id=4, fingerprint="0123abcd", memory=rpc.Memory(used=3 << 30, free=5 << 30, at=1764130000.5)),
    rpc.KvCacheCleared(id=5),
    rpc.PrefixDiskOpened(id=12, saved={"0123abcd": 9}),
    rpc.PrefixesLoaded(id=13, failed=[]),
    rpc.PrefixDiskFlushed(id=14, written=True),
    rpc.MemoryRead(
        id=15,
        memory=rpc.Memory(used=3 << 30, free=5 << 30, at=1764130000.5, total=8 << 30, caches=1 << 30, peak=64 << 20),
    ),
    rpc.Bye(id=7),
    rpc.Error(id=None, kind="invalid_json", message="bad"),
    rpc.Error(id=4, kind="out_of_memory", message="rank 1: RuntimeError: [malloc] Unable to allocate 1024 bytes."),
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
    """A generate_step line, well formed but for ``fields`` of its plan's first prefill chunk."""
    chunk = {
        "seq": 1,
        "position": 0,
        "tokens": [1],
        "last": True,
        "copies": [],
        "scores": False,
        "pool": "",
        "images": [],
        "positions": [],
        "adapter": 0,
        **fields,
    }
    plan = {
        "leave": [],
        "prefill": [chunk],
        "decode": [{"seq": 2, "token": 1, "micro_batch": 0, "draft": [4, 5], "drop": 1, "rope_delta": 0, "adapter": 0}],
        "restore": [{"seq": 1, "entry": 3, "tokens": 2}],
        "save": [{"seq": 1, "entry": 4, "tokens": 0}],
        "evict": [{"entry": 3, "key": ""}],
        "ahead": False,
    }
    return json.dumps({"op": "generate_step", "id": 4, "plan": plan, "read_memory": False}).encode()


MALFORMED = [
    (b"{not json", ErrorKind.INVALID_JSON, None),
    (b"\xff\xfe garbage", ErrorKind.INVALID_JSON, None),
    (b"[1, 2]", ErrorKind.INVALID_JSON, None),
    (b"", ErrorKind.INVALID_JSON, None),
    (b'{"op": "fly", "id": 3}', ErrorKind.UNKNOWN_OP, 3),
    (b'{"id": 3}', ErrorKind.UNKNOWN_OP, 3),
    (b'{"op": "pong", "id": 3}', ErrorKind.UNKNOWN_OP, 3),  # a reply is not a request
    (b'{"op": "generate_step", "id": 4, "decode_tokens": [1]}', ErrorKind.INVALID_FIELD, 4),
    (_step_line(tokens=["2"]), ErrorKind.INVALID_FIELD, 4),
    (_step_line(tokens=[True]), ErrorKind.INVALID_FIELD, 4),
    (_step_line(tokens=[1.5]), ErrorKind.INVALID_FIELD, 4),
    (_step_line(last=1), ErrorKind.INVALID_FIELD, 4),
    (_step_line(extra=1), ErrorKind.INVALID_FIELD, 4),
    (b'{"op": "ping", "id": 5, "extra": 1}', ErrorKind.INVALID_FIELD, 5),
    (b'{"op": "ping", "id": "5"}', ErrorKind.INVALID_FIELD, None),
    (
        b'{"op": "init", "id": 6, "backend": "ring", "env": {"A": 1}, "files": {}, "settings": {}}',
        ErrorKind.INVALID_FIELD,
        6,
    ),
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
        rpc.decode_request(b'{"op": "generate_step", "id": 1, "plan": "abc", "bogus": 0}')
    assert "'plan' must be StepPlan" in caught.value.message
    assert "unknown field 'bogus'" in caught.value.message
    with pytest.raises(rpc.ProtocolError) as caught:
        rpc.decode_request(_step_line(tokens="abc", last=None))
    message = caught.value.message
    assert "'plan.prefill[0].tokens' must be list[int]" in message
    assert "'plan.prefill[0].last' must be bool" in message


def test_nested_fields_come_back_as_their_types() -> None:
    step = rpc.decode_request(_step_line())
    assert isinstance(step, rpc.GenerateStep)
    assert step.plan.prefill == [rpc.Prefill(1, 0, [1], True)] and step.plan.decode == [rpc.Decode(2, 1, 0, [4, 5], 1)]
    assert step.plan.restore == [rpc.Restore(1, 3, 2)] and step.plan.save == [rpc.Save(1, 4)]
    assert step.plan.evict == [rpc.Evict(3)]


def test_the_hub_token_shows_in_no_repr() -> None:
    message = rpc.CheckModel(id=1, model="org/gated", token="hf_secret")
    assert "hf_secret" not in repr(message) and "hf_secret" not in str(message)
