"""A quantized KV cache (``--kv-bits``): the batched cache checked against mlx-lm's own one-sequence cache and the
disk tier's files (unit: no model, no process), then real servers: greedy output close to unquantized on the
embedded SmolLM2, the same tokens batched as alone, at TP=2 and PP=2 as at TP=1 (with drafts verified and prompts
fed in chunks), restored from the prefix cache and from disk as computed, and bad values refused.
"""

from __future__ import annotations

import contextlib
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import httpx
import mlx.core as mx
import pytest
from closeness import TOP, Scored, assert_same
from conftest import Server, serving
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache
from tiny_archs import make_arch_model

from neuron.cli.main import _parser
from neuron.config import sources
from neuron.models import architectures
from neuron.models.folder import KV_GROUP_SIZE
from neuron.rank.kv import caches, rollback
from neuron.rank.kv.disk import Disk, DiskError
from neuron.rank.kv.quantized import BatchQuantizedKVCache
from testkit import agreement, run_neuron_side_by_side, serving_side_by_side

HEADS, DIM = 2, 64


def _kv(rows: int, tokens: int, seed: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return mx.random.normal((rows, HEADS, tokens, DIM)), mx.random.normal((rows, HEADS, tokens, DIM))


def _alone(lengths: list[int], bits: int, seed: int) -> list[QuantizedKVCache]:
    out = []
    for i, n in enumerate(lengths):
        cache = QuantizedKVCache(KV_GROUP_SIZE, bits)
        cache.update_and_fetch(*_kv(1, n, seed + i))
        out.append(cache)
    return out


def _attend(cache: object, queries: mx.array, mask: mx.array | str | None) -> mx.array:
    keys, values = cache.keys_and_values()  # type: ignore[attr-defined]
    # mlx-lm's quantized attention scales the queries in place: each call gets its own.
    return scaled_dot_product_attention(queries + 0, keys, values, cache=cache, scale=DIM**-0.5, mask=mask)


def _same_rows(batch: BatchQuantizedKVCache, alone: list[QuantizedKVCache], seed: int) -> None:
    """A decode step's token written to each row attends as it does written to the one-sequence cache alone, and
    then each row holds what that cache holds, bit for bit."""
    mask = batch.make_mask(1)
    keys, values = _kv(len(alone), 1, seed)
    batch.update_and_fetch(keys, values)
    queries = mx.random.normal((len(alone), HEADS * 2, 1, DIM))
    batched = _attend(batch, queries, mask)
    for i, one in enumerate(alone):
        one.update_and_fetch(keys[i : i + 1], values[i : i + 1])
        assert mx.allclose(batched[i : i + 1], _attend(one, queries[i : i + 1], None), atol=1e-5)
        row = batch.extract(i)
        assert row.offset == one.offset
        for mine, theirs in zip((*row.keys, *row.values), (*one.keys, *one.values), strict=True):
            assert mx.array_equal(mine, theirs[..., : one.offset, :])


@pytest.mark.unit
@pytest.mark.parametrize("bits", [8, 4])
def test_the_batched_quantized_cache_holds_and_attends_as_mlx_lms_one_sequence_cache(bits: int) -> None:
    alone = _alone([5, 300, 17], bits, seed=1)
    batch = caches.merge([[c] for c in alone])[0]
    assert isinstance(batch, BatchQuantizedKVCache)
    _same_rows(batch, alone, seed=9)
    # Rows joining (extend), leaving (filter), and a draft's tail dropped by different amounts per row.
    joining = _alone([40, 2], bits, seed=20)
    batch.extend(caches.merge([[c] for c in joining])[0])
    alone += joining
    batch.filter([0, 2, 3, 4])
    alone = [alone[i] for i in (0, 2, 3, 4)]
    _same_rows(batch, alone, seed=10)
    rollback.drop_tail([batch], [0, 1, 2, 1])
    for one, drop in zip(alone, [0, 1, 2, 1], strict=True):
        one.trim(drop)
    _same_rows(batch, alone, seed=11)
    assert caches.cuttable([batch]) and isinstance(caches.copied([alone[0]])[0], QuantizedKVCache)


@pytest.mark.unit
def test_new_prompts_get_a_quantized_padded_batch_where_the_model_keeps_quantized_caches() -> None:
    batch = caches.padded_batch([QuantizedKVCache(KV_GROUP_SIZE, 4)], [3, 0])
    assert isinstance(batch[0], BatchQuantizedKVCache) and batch[0].bits == 4
    batch[0].update_and_fetch(*_kv(2, 6, seed=3))
    assert batch[0].extract(0).offset == 3 and batch[0].extract(1).offset == 6


def _quantized_layers(tokens: int, bits: int) -> list[tuple[tuple[mx.array, ...], tuple[mx.array, ...]]]:
    keys, values = _kv(1, tokens, seed=5)
    return [(tuple(mx.quantize(keys, KV_GROUP_SIZE, bits)), tuple(mx.quantize(values, KV_GROUP_SIZE, bits)))] * 2


@pytest.mark.unit
def test_a_quantized_entry_reads_back_from_disk_and_a_file_of_other_bits_is_foreign(tmp_path: Path) -> None:
    disk = Disk(tmp_path, 1 << 20, "stamp", 0, kv_bits=8)
    disk.spill("k", 5, _quantized_layers(5, 8))  # type: ignore[arg-type]
    assert disk.flush(10.0) and disk.scan() == {"k": 5}
    tokens, layers = disk.load("k")
    assert tokens == 5
    for got, want in zip(layers, _quantized_layers(5, 8), strict=True):
        for mine, theirs in zip((*got[0], *got[1]), (*want[0], *want[1]), strict=True):  # type: ignore[misc]
            assert mine.dtype == theirs.dtype and mx.array_equal(mine, theirs)
    for other in (Disk(tmp_path, 1 << 20, "stamp", 0, kv_bits=4), Disk(tmp_path, 1 << 20, "stamp", 0)):
        assert other.scan() == {}
        with pytest.raises(DiskError, match=r"holds a KV cache of 8 bits \(--kv-bits\), and this server keeps"):
            other.load("k")
        other.close(1.0)
    disk.close(1.0)


@pytest.mark.unit
def test_bad_bits_and_models_whose_caches_cannot_be_quantized_are_refused() -> None:
    args = _parser().parse_args(["serve", "--kv-bits", "3"])
    assert sources.resolve(args, "serve") == [
        "--kv-bits must be 8 or 4 (bits per cached key and value), got 3; leave it unset to keep it unquantized"
    ]
    llama = {"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256}
    architectures.check_kv_bits(llama, 4, KV_GROUP_SIZE)  # heads of 64
    refusals = {
        "gemma3_text": "key/value \\+ sliding window ones",
        "qwen3_5": "linear-attention state ones",
        "deepseek_v3": "latent attention",
    }
    for arch, why in refusals.items():
        model = {**llama, "model_type": arch, "kv_lora_rank": 512 if arch == "deepseek_v3" else 0}
        with pytest.raises(architectures.Unsupported, match=f"--kv-bits 4: '{arch}' cannot .*{why}.*without --kv-bits"):
            architectures.check_kv_bits(model, 4, KV_GROUP_SIZE)
    with pytest.raises(architectures.Unsupported, match="heads are 40 wide"):
        architectures.check_kv_bits({**llama, "head_dim": 40}, 8, KV_GROUP_SIZE)


# Of the unquantized embedded SmolLM2's 64 greedy tokens after each of testkit.agreement's questions, the share that
# the model with a quantized cache also ranks first given the same history (teacher-forced: one early near tie does
# not decide the other 63), as measured on the CPU (docs/caching.md and BENCHMARKS.md give the figures and the
# command); the floors are a little under them, for devices whose kernels round differently.
AGREEMENT_FLOOR = {8: 0.97, 4: 0.75}


def test_greedy_output_with_a_quantized_kv_cache_stays_close_to_unquantized_on_smollm2(
    smollm2_server: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with contextlib.ExitStack() as stack:
        # Both quantized servers load while the unquantized one answers.
        logs = {bits: tmp_path_factory.mktemp("serve") / "serve.log" for bits in AGREEMENT_FLOOR}
        servers = {bits: Server("--kv-bits", str(bits), log_path=logs[bits]) for bits in AGREEMENT_FLOOR}
        for server in servers.values():
            stack.callback(lambda s=server: s.stop() == 0 or pytest.fail(s.stderr()))
        every = agreement.histories(smollm2_server, agreement.QUESTIONS)
        assert all(len(h) > agreement.TOKENS for h in every)
        # The three servers score the histories side by side, each one history at a time as the figures were
        # measured (one row: deterministic on the CPU); one after the other they left a core idle.
        with ThreadPoolExecutor(1 + len(servers)) as pool:
            wanted = pool.submit(agreement.every_firsts, smollm2_server, every)
            got = {
                bits: pool.submit(lambda s=server: agreement.every_firsts(s.start(), every))
                for bits, server in servers.items()
            }
        rates: dict[int, float] = {}
        for bits, floor in AGREEMENT_FLOOR.items():
            rate = rates[bits] = agreement.share(wanted.result(), got[bits].result())
            print(f"kv bits {bits}: greedy agreement over {agreement.TOKENS} tokens {rate:.3f}")
            assert rate >= floor, f"--kv-bits {bits}: agreement {rate:.3f} under {floor}"
        # Served caches that were not quantized at all would agree everywhere: at 4 bits this model's do not.
        assert rates[4] < 1, "--kv-bits 4: every token agreed, as if the ranks kept unquantized caches"


# The tiny qwen3 (tests/conftest.py). Repetitive prompts, so that prompt lookup drafts; some longer than the
# prefill chunk (16 tokens), so that they are fed over several steps.
PROMPTS = [
    "one two three four one two three four one two three four one two",
    "hello",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "def add(a, b):\n    return a + b\n\ndef add(",
]
MAX_TOKENS = [33, 25, 40, 29]
SPLITS = {"tp1": ("--tp", "1"), "tp2": ("--tp", "2"), "pp2": ("--pp", "2", "--micro-batches", "2")}


def _complete(server: Server, prompt: str, max_tokens: int, **extra: object) -> dict:
    body = {"model": "qwen3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": TOP}
    reply = httpx.post(f"{server.url}/v1/completions", json={**body, **extra}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


async def _together(server: Server) -> list[dict]:
    out: list[dict] = [{} for _ in PROMPTS]

    def one(i: int) -> None:
        out[i] = _complete(server, PROMPTS[i], MAX_TOKENS[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(anyio.to_thread.run_sync, one, i)
    return out


def _scored(replies: list[dict]) -> list[Scored]:
    return [Scored.of(r["choices"][0]) for r in replies]


@pytest.mark.anyio
async def test_quantized_caches_give_the_same_tokens_batched_drafted_restored_and_split(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """At TP=1, TP=2 and PP=2 with 4-bit caches: the prompts fed together (new prompts in one padded batch, long
    ones in chunks) and decoded together with drafts give what each gives alone without drafts, restored from the
    prefix cache the first round saved; and TP=2 and PP=2 give what TP=1 gives."""
    runs: dict[str, list[Scored]] = {}
    kept: dict[str, int] = {}  # draft tokens kept in the round fed together, by split
    args = ("--model", str(tiny_models["qwen3"]), "--prefill-chunk", "16", "--kv-bits", "4")
    with serving_side_by_side(tmp_path_factory, *((*args, *split) for split in SPLITS.values())) as servers:
        for name, server in zip(SPLITS, servers, strict=True):  # asked one at a time: only their starts overlap
            together = await _together(server)
            alone = [_complete(server, p, n, num_draft_tokens=0) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
            kept[name] = sum(r["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] for r in together)
            assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in together)
            restored = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in alone]
            assert restored == [r["usage"]["prompt_tokens"] - 1 for r in alone], restored  # all but the last token
            runs[name] = _scored(together)
            for i, (want, got) in enumerate(zip(_scored(alone), runs[name], strict=True)):
                assert_same(want, got, f"{name}: prompt {i} together and drafted, against alone and restored")
    for name in ("tp2", "pp2"):
        for i, (want, got) in enumerate(zip(runs["tp1"], runs[name], strict=True)):
            assert_same(want, got, f"prompt {i}: {name} against tp1")
    # Drafts were verified and kept over quantized caches. Summed over the splits: whether a step drafts is the
    # engine's choice from the step times it measures (engine.drafts.width), and a split timed while the suite's
    # other processes run may price drafting out of its short round (seen at TP=2 beside three busy loops).
    assert sum(kept.values()) > 0, f"no draft token kept at any split: {kept}"


def test_a_restarted_server_restores_quantized_entries_from_disk_and_skips_files_of_other_bits(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("kv")
    args = ("--model", str(tiny_models["qwen3"]), "--tp", "2", "--prefix-cache-dir", str(folder))
    with serving(tmp_path_factory, *args, "--kv-bits", "8") as server:
        fresh = _complete(server, PROMPTS[2], 12)
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert sorted(p.name.split(".")[1] for p in folder.glob("*.kv")) == ["r0", "r1"]
    # Restarted with the same bits and with others, side by side: the latter on a copy of the folder, which it
    # writes to.
    copy = tmp_path_factory.mktemp("kv-copy")
    shutil.copytree(folder, copy, dirs_exist_ok=True)
    commands = ((*args, "--kv-bits", "8"), (*args[:-1], str(copy), "--kv-bits", "4"))
    with serving_side_by_side(tmp_path_factory, *commands) as (same, others):
        restored = _complete(same, PROMPTS[2], 12)
        other = _complete(others, PROMPTS[2], 12)
        skipped = others.find_log("prefix cache file skipped")
        assert skipped is not None and "8 bits (--kv-bits), and this server keeps 4 bits" in skipped["reason"]
    assert restored["usage"]["prompt_tokens_details"]["cached_tokens"] == restored["usage"]["prompt_tokens"] - 1
    assert_same(Scored.of(fresh["choices"][0]), Scored.of(restored["choices"][0]), "restored from disk")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_generate_takes_kv_bits_and_refuses_bad_bits_and_a_model_whose_caches_cannot_be_quantized(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    windowed = make_arch_model(tmp_path / "gemma3", "gemma3_text")
    made, bad, refused = run_neuron_side_by_side(
        ("generate", "--model", str(tiny_models["qwen3"]), "--kv-bits", "4", "--max-tokens", "8", "hi"),
        ("generate", "--kv-bits", "3", "hi"),
        ("generate", "--model", str(windowed), "--kv-bits", "8", "hi"),
    )
    assert made.returncode == 0 and "8 tokens" in made.stderr, made.stderr
    assert bad.returncode == 2 and "--kv-bits must be 8 or 4" in bad.stderr, bad.stderr
    assert refused.returncode != 0, refused.stderr
    assert "--kv-bits 8: 'gemma3_text' cannot keep a quantized KV cache" in refused.stderr, refused.stderr
    assert "serve it without --kv-bits" in refused.stderr
