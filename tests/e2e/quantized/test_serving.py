"""Quantized weights served on the CPU through neuron's kernel: a GGUF file's blocks kept as MLX's quantized layout
(the embedded SmolLM2's Q4_1, tiny models written as Q4_1, Q8_0 and Q4_K_M: its Q4_K, Q5_0 and Q8_0 kept, its Q6_K
dequantized),
and folders ``mlx_lm.convert -q`` writes, give the greedy text of the same weights dequantized to float32, alone, in
two tensor-parallel ranks and in two pipeline stages. The repack is exact, so the tokens are the same: the kernel
sums the same products as BLAS does over the dequantized weights, in another order, which moves a logit by far less
than these models' top two differ by.
``NEURON_QUANTIZED_KERNEL=off`` (as a machine without a C++ compiler) keeps today's path: a GGUF file dequantized,
an MLX folder through MLX's own product, each logged with how to get the kernel. The kernel itself:
tests/e2e/quantized/test_kernel.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest

from neuron.system.native import QUANTIZED_ENV
from neuron.system.paths import cache_dir
from testkit import make_tiny_model, run_neuron_side_by_side
from testkit.gguf_files import write_gguf

PROMPT = "The history of the Roman empire"
OFF = {QUANTIZED_ENV: "off"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache for this module's conversions that shares this machine's native builds: the kernel is built once."""
    folder = tmp_path_factory.mktemp("cache")
    (cache_dir() / "native").mkdir(parents=True, exist_ok=True)
    (folder / "native").symlink_to(cache_dir() / "native")
    return folder


def generate(runs: list[tuple[dict[str, str], tuple[str, ...]]], cache: Path | None, tokens: int = 64) -> list[Ran]:
    """Each run's greedy text and log: ``(environment, arguments)``, those of one environment side by side."""
    base = {"NEURON_CACHE_DIR": str(cache)} if cache is not None else {}
    groups: dict[tuple[tuple[str, str], ...], list[int]] = {}
    for i, (env, _) in enumerate(runs):
        groups.setdefault(tuple(sorted(env.items())), []).append(i)
    out: dict[int, Ran] = {}
    for env, indices in groups.items():
        commands = [("generate", "--max-tokens", str(tokens), "--log-level", "info", *runs[i][1]) for i in indices]
        for i, done in zip(indices, run_neuron_side_by_side(*commands, env={**base, **dict(env)}), strict=True):
            assert done.returncode == 0, done.stderr[-3000:]
            out[i] = Ran(done.stdout, done.stderr)
    return [out[i] for i in range(len(runs))]


@dataclass(frozen=True)
class Ran:
    text: str
    log: str


def test_the_embedded_q4_1_file_stays_quantized_and_answers_as_dequantized_alone_and_in_stages() -> None:
    runs = generate([(OFF, (PROMPT,)), ({}, (PROMPT,)), ({}, ("--pp", "2", PROMPT))], cache=None)
    dequantized, alone, staged = runs
    assert "quantized products by neuron's kernel" not in dequantized.log
    assert "quantized products by neuron's kernel" in alone.log and '"products": 121' in alone.log
    assert dequantized.text.strip() and alone.text == dequantized.text and staged.text == dequantized.text


# Every split for Q4_1; Q8_0's layout and a Q4_K_M mix alone (the same code splits them). The mix is 288 wide: as
# SmolLM2's 576, not whole super-blocks of 256, so that, as in its real Q4_K_M file, most matrices are the Q5_0
# llama.cpp writes instead (8 bits, float32 scales), some Q8_0, beside Q4_K's 4 bits and Q6_K dequantized.
@pytest.mark.parametrize(
    ("model_type", "arch", "quant", "hidden", "splits"),
    [
        ("llama", "llama", "Q4_1", 256, [(), ("--tp", "2"), ("--pp", "2")]),
        ("qwen3", "qwen3", "Q8_0", 256, [()]),
        ("llama", "llama", "Q4_K_M", 288, [()]),
    ],
)
def test_a_quantized_gguf_file_answers_as_dequantized_alone_split_and_in_stages(
    tmp_path: Path, cache: Path, model_type: str, arch: str, quant: str, hidden: int, splits: list[tuple[str, ...]]
) -> None:
    folder = make_tiny_model(tmp_path / f"tiny-{model_type}", model_type, seed=7, hidden=hidden, intermediate=512)
    gguf = write_gguf(folder, tmp_path / f"tiny-{model_type}-{quant}.gguf", arch, quant=quant)
    model = ("--model", str(gguf), PROMPT)
    dequantized, *runs = generate([(OFF, model), *(({}, (*split, *model)) for split in splits)], cache)
    assert "gguf dequantized" in dequantized.log and f"{QUANTIZED_ENV}=off" in dequantized.log
    assert dequantized.text
    if quant == "Q4_K_M":  # the mix is what it is said to be
        assert '"quantized_formats": "Q4_K:4,Q5_0:18,Q8_0:4"' in runs[0].log
    for split, run in zip(splits, runs, strict=True):
        assert "quantized products by neuron's kernel" in run.log, split
        assert run.text == dequantized.text, split


def _dequantized_copy(folder: Path, out: Path) -> Path:
    """``folder``'s quantized weights dequantized to float32: the same model, unquantized."""
    shutil.copytree(folder, out)
    config = json.loads((folder / "config.json").read_text())
    group, bits = config["quantization"]["group_size"], config["quantization"]["bits"]
    arrays = mx.load(str(folder / "model.safetensors"))
    dense = {}
    for name, array in arrays.items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{base}.scales" in arrays:
            scales, biases = (arrays[f"{base}.{leaf}"].astype(mx.float32) for leaf in ("scales", "biases"))
            dense[name] = mx.dequantize(array, scales, biases, group, bits)
        elif not name.endswith((".scales", ".biases")):
            dense[name] = array
    mx.save_safetensors(str(out / "model.safetensors"), dense)
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    return out


@pytest.mark.parametrize(("bits", "group_size", "checks"), [(4, 64, True), (8, 32, False)])
def test_an_mlx_quantized_folder_decodes_through_the_kernel_as_its_dequantized_copy(
    tmp_path: Path, bits: int, group_size: int, checks: bool
) -> None:
    """4 bits also in two tensor-parallel ranks, and with the kernel off (MLX's product, and the log's reason)."""
    from mlx_lm import convert

    folder = make_tiny_model(tmp_path / "tiny", "llama", seed=3)
    quantized = tmp_path / f"tiny-{bits}bit"
    convert(str(folder), str(quantized), quantize=True, q_bits=bits, q_group_size=group_size)
    dense = _dequantized_copy(quantized, tmp_path / "dense")
    runs = [({}, ("--model", str(quantized), PROMPT)), ({}, ("--model", str(dense), PROMPT))]
    if checks:
        runs += [(OFF, ("--model", str(quantized), PROMPT)), ({}, ("--model", str(quantized), "--tp", "2", PROMPT))]
    through_kernel, dequantized, *more = generate(runs, cache=None, tokens=32)
    assert "quantized products by neuron's kernel" in through_kernel.log
    assert dequantized.text and through_kernel.text == dequantized.text
    if checks:
        through_mlx, split = more
        said = through_mlx.log
        assert "quantized products by MLX" in said and f"{QUANTIZED_ENV}=off" in said and "neuron[cpu]" in said
        assert split.text == dequantized.text
