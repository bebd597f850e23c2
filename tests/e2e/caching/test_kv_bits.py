"""A quantized KV cache (``--kv-bits``) on real servers: greedy output close to unquantized on the embedded SmolLM2,
the same tokens batched as alone, at TP=2 and PP=2 as at TP=1 (with drafts verified and prompts fed in chunks),
restored from the prefix cache and from disk as computed, and bad values refused. The cache itself, checked
against mlx-lm's: tests/unit/rank/kv/test_kv_bits.py."""

from __future__ import annotations

import contextlib
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import httpx
import pytest

from testkit import Server, agreement, run_neuron_side_by_side, serving, serving_side_by_side
from testkit.closeness import TOP, Scored, assert_same
from testkit.tiny_archs import make_arch_model

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
