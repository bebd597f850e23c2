"""The prefix cache's disk tier (``--prefix-cache-dir``) on a real server at TP=2 and at PP=2 restarted on its folder:
the same prompt is restored instead of computed, with the same greedy tokens, and a corrupted file is skipped with a
warning; so are a sliding-window model's and a linear-attention model's snapshots, where a prompt begins with a
whole saved one. Each rank's files checked directly: tests/unit/rank/kv/test_prefix_disk.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from neuron.models.folder import cache_bytes
from testkit import Server, serving, serving_side_by_side
from testkit.closeness import TOP, Scored, assert_same
from testkit.tiny_archs import make_arch_model

PROMPT = "The keeper climbs the stairs at dusk and lights the lamp. " * 20


def _ask(server: Server, prompt: str = PROMPT, model: str = "qwen3") -> tuple[Scored, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": TOP}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return Scored.of(reply.json()["choices"][0]), reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _files(folder: Path) -> list[str]:
    """The files each rank wrote in ``folder`` after one prompt (one each, its own share)."""
    files = sorted(p.name for p in folder.glob("*.kv"))
    assert [name.split(".")[1] for name in files] == ["r0", "r1"]  # each rank wrote its own heads or layers
    assert (folder / files[0]).read_bytes() != (folder / files[1]).read_bytes()
    return files


def _restored(server: Server, fresh: Scored, args: tuple[str, ...]) -> None:
    """A fresh server on the folder restores the prompt instead of computing it, with the same greedy tokens."""
    restored, cached = _ask(server)
    assert cached == len(PROMPT) - 1  # one token a byte; all but the last, which is always fed
    assert server.find_log("prefill done", cached_tokens=cached) is not None
    assert_same(fresh, restored, f"restored from disk ({' '.join(args[2:4])})")


def test_a_restarted_server_restores_each_ranks_heads_or_each_stages_layers_from_disk_and_skips_a_corrupted_file(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """At TP=2 (each rank's heads) and at PP=2 (each stage's layers), each on its own folder: the prompt computed,
    then a restarted server restores it; and at TP=2 a restart on a copy whose rank-1 file is corrupted computes
    it. The servers of each round start side by side (a start is mostly one process importing) and are asked one
    at a time; each failure names its split."""
    model = str(tiny_models["qwen3"])
    folders = {split: tmp_path_factory.mktemp(f"kv-{split}") for split in ("tp", "pp")}
    tp, pp = (("--model", model, f"--{split}", "2", "--prefix-cache-dir", str(folders[split])) for split in folders)
    with serving_side_by_side(tmp_path_factory, tp, pp) as servers:
        computed = [_ask(server) for server in servers]
    assert [cached for _, cached in computed] == [0, 0]  # nothing on disk yet
    (fresh, _), (fresh_pp, _) = computed
    files = _files(folders["tp"])
    _files(folders["pp"])

    corrupted = tmp_path_factory.mktemp("kv-corrupted")
    shutil.copytree(folders["tp"], corrupted, dirs_exist_ok=True)
    target = corrupted / files[1]
    data = bytearray(target.read_bytes())
    data[-100] ^= 0xFF
    target.write_bytes(bytes(data))
    # Restarted on each folder and, side by side, on the corrupted copy.
    commands = (tp, (*tp[:-1], str(corrupted)), pp)
    with serving_side_by_side(tmp_path_factory, *commands) as (server, on_corrupted, pipeline):
        _restored(server, fresh, tp)
        _restored(pipeline, fresh_pp, pp)
        again, cached = _ask(on_corrupted)
        assert cached == 0  # rank 1's file failed its checksum: the entry is loaded on no rank
        skipped = on_corrupted.find_log("prefix cache file skipped")
        assert skipped is not None and "checksum" in skipped["reason"], on_corrupted.stderr()
    assert_same(fresh, again, "computed again")


# A saved prompt, and a longer one beginning with it: a model whose entries are snapshots restores only a whole one.
SHORT = "The keeper climbs the stairs at dusk and lights the lamp. " * 2
LONG = SHORT + "Ships pass."
LONGEST = LONG + " Gulls cry."
ELSE = "A ferry crosses the bay twice a day."


def _snapshots_restored(
    factory: pytest.TempPathFactory, arch: str, layout: tuple[str, ...], read_back: bool, corrupt: bool
) -> None:
    """A model whose entries are snapshots (a sliding window, a linear-attention state), restarted on its folder:
    the longer prompt is computed, then the shorter; after the restart the longer prompt restores the shorter one
    from disk and gives the tokens its fresh prefill gave. ``layout``: two ranks, each writing its own file (its
    heads at ``--tp 2``, its stage's layers at ``--pp 2``).

    ``read_back``: memory holds one entry, and the longest prompt, computed first, then asked again once the
    others have pushed every entry but another prompt's to disk, reads the longer one back while serving (not the
    shorter: an entry is read back only where it holds more of a prompt than memory does, and the longest one
    there is read). ``corrupt``: another prompt's rank-1 file is damaged before the restart, and is skipped with
    a warning and computed."""
    model = make_arch_model(factory.mktemp(arch) / arch, arch)
    folder = factory.mktemp(f"kv-{arch}")
    args = ("--model", str(model), *layout, "--prefix-cache-dir", str(folder))
    per_token, per_entry = cache_bytes(model, [(0, 2), (2, 4)] if "--pp" in layout else [], 2)
    one_entry = ("--prefix-cache-bytes", str(len(LONGEST) * per_token + per_entry))  # the longest, and one only
    with serving(factory, *args, *(one_entry if read_back else ())) as server:
        longest = _ask(server, LONGEST, arch)[0] if read_back else None
        fresh, cached = _ask(server, LONG, arch)
        assert cached == 0 and _ask(server, SHORT, arch)[1] == 0  # a longer entry cannot be cut back
        if corrupt or read_back:
            _ask(server, ELSE, arch)
        if longest is not None:
            again, cached = _ask(server, LONGEST, arch)
            assert cached == len(LONG), server.stderr()
            assert server.find_log("prefix cache entry read back from disk", tokens=cached) is not None
            assert_same(longest, again, f"{arch}: read back from disk while serving, against a fresh prefill")
    keys = {len(json.loads(p.read_text())): p.name.split(".")[0] for p in folder.glob("*.tokens")}  # by length
    asked = (SHORT, LONG, *((LONGEST,) if read_back else ()), *((ELSE,) if corrupt or read_back else ()))
    assert sorted(keys) == sorted(len(prompt) for prompt in asked), list(folder.iterdir())
    for key in keys.values():  # each rank wrote its own share of every entry
        assert sorted(p.name for p in folder.glob(f"{key}.r*.kv")) == [f"{key}.r0.kv", f"{key}.r1.kv"]
    if corrupt:
        target = folder / f"{keys[len(ELSE)]}.r1.kv"
        data = bytearray(target.read_bytes())
        data[-10] ^= 0xFF
        target.write_bytes(bytes(data))
    with serving(factory, *args) as server:
        restored, cached = _ask(server, LONG, arch)
        assert cached == len(SHORT), server.stderr()  # the whole saved prompt, restored from disk
        assert server.find_log("prefill done", cached_tokens=cached) is not None
        if corrupt:
            # Its file failed its checksum on one rank: it is loaded on none.
            assert _ask(server, ELSE + " Again.", arch)[1] == 0
            skipped = server.find_log("prefix cache file skipped")
            assert skipped is not None and "checksum" in skipped["reason"], server.stderr()
    assert_same(fresh, restored, f"{arch} ({' '.join(layout)}): restored from disk after a restart, not computed")


def test_a_sliding_window_models_entries_are_restored_and_read_back_from_disk_by_each_stage(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _snapshots_restored(tmp_path_factory, "gpt_oss", ("--pp", "2", "--pp-layers", "2,2"), read_back=True, corrupt=False)


def test_a_linear_attention_models_entries_are_restored_from_disk_on_each_rank_and_a_corrupted_one_skipped(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _snapshots_restored(tmp_path_factory, "qwen3_next", ("--tp", "2"), read_back=False, corrupt=True)


OTHER = "A ferry crosses the bay twice a day and waits at the pier for the mail. " * 16


def _tokens_file(folder: Path, seen: set[str]) -> Path:
    """Rank 1's one file in ``folder`` not in ``seen`` (added to it)."""
    (new,) = {p.name for p in folder.glob("*.r1.kv")} - seen
    seen.add(new)
    return folder / new


def test_an_entry_spilled_while_serving_is_read_back_before_its_prompt_is_computed(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("kv-serving")
    # Memory holds one of the two prompts (2 KiB a token on each rank): each evicts the other to disk.
    model = str(tiny_models["qwen3"])
    args = ("--model", model, "--tp", "2", "--prefix-cache-dir", str(folder), "--prefix-cache-bytes", "3000000")
    seen: set[str] = set()
    with serving(tmp_path_factory, *args) as server:
        first, _ = _ask(server)
        other, _ = _ask(server, OTHER)  # the first prompt's entry goes to disk
        _tokens_file(folder, seen)
        again, cached = _ask(server)
        assert cached == len(PROMPT) - 1, server.stderr()  # read back from disk, not computed
        assert server.find_log("prefix cache entry read back from disk") is not None
        assert_same(first, again, "read back from disk while serving")
        # The other prompt's entry went to disk in turn; a flipped bit in rank 1's file: rank 0 loads it, rank 1
        # does not, and both drop it again; the prompt is computed.
        target = _tokens_file(folder, seen)
        data = bytearray(target.read_bytes())
        data[-100] ^= 0xFF
        target.write_bytes(bytes(data))
        computed, cached = _ask(server, OTHER)
        assert cached == 0
        skipped = server.find_log("prefix cache file skipped")
        assert skipped is not None and "checksum" in skipped["reason"], server.stderr()
        assert_same(other, computed, "computed after a corrupted file")
        assert _ask(server)[1] == len(PROMPT) - 1  # the ranks agree still: the first prompt is read back again
