"""GGUF files beyond llama (neuron/models/gguf.py): tiny Qwen3, Qwen2 and Mistral models written as GGUF files with the
``gguf`` package (testkit/gguf_files.py), converted and served, give the greedy text of the same weights in
safetensors; one named on a (local) Hub as ``ORG/NAME:QUANT`` too; any other architecture is refused by name."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import httpx
import numpy as np
import pytest

from testkit import Server, make_tiny_model, run_neuron, run_neuron_side_by_side
from testkit.gguf_files import train_sentencepiece, write_gguf
from testkit.hub import LocalHub

PROMPT = "The hub"


def _generating(model: str | Path) -> tuple[str, ...]:
    return ("generate", "--model", str(model), "--max-tokens", "16", PROMPT)


def generate(model: str | Path, cache: Path) -> str:
    done = run_neuron(*_generating(model), env={"NEURON_CACHE_DIR": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def generate_side_by_side(cache: Path, *models: str | Path) -> list[str]:
    """``generate`` for each model, run side by side (each run is mostly one process's start)."""
    runs = run_neuron_side_by_side(*map(_generating, models), env={"NEURON_CACHE_DIR": str(cache)})
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
    return [done.stdout for done in runs]


@pytest.mark.parametrize(
    ("model_type", "arch", "pre"),
    [
        ("qwen3", "qwen3", "qwen2"),
        ("qwen2", "qwen2", "qwen2"),
        ("mistral", "llama", "default"),
        ("gemma", "gemma", "default"),
    ],
)
def test_a_gguf_file_gives_the_text_of_its_safetensors(tmp_path: Path, model_type: str, arch: str, pre: str) -> None:
    folder = make_tiny_model(tmp_path / f"tiny-{model_type}", model_type, seed=7)
    gguf = write_gguf(folder, tmp_path / f"tiny-{model_type}-F32.gguf", arch, pre)
    from_folder, from_gguf = generate_side_by_side(tmp_path / "cache", folder, gguf)
    assert from_folder.strip()
    assert from_gguf == from_folder


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece_does(tmp_path: Path) -> None:
    import gguf as ggml
    import sentencepiece
    from tokenizers import Tokenizer

    from neuron.models.gguf import _sentencepiece_json, metadata

    model = train_sentencepiece(tmp_path / "spm")
    folder = make_tiny_model(tmp_path / "tiny-mistral", "mistral", vocab=330)
    gguf = write_gguf(folder, tmp_path / "tiny-mistral.gguf", "llama", sentencepiece=model)
    tokenizer = Tokenizer.from_str(_sentencepiece_json(metadata(ggml.GGUFReader(gguf))))
    reference = sentencepiece.SentencePieceProcessor(model_file=str(model))
    for text in ["The hub serves héllo 42", "  two  spaces", "tab\tand\nnewline", "ünïcödé 🙂 x", "12345 67890"]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("hi").ids[0] == reference.bos_id()  # BOS first, as llama.cpp adds it


def test_a_mistral_gguf_with_a_sentencepiece_tokenizer_gives_the_text_of_its_safetensors(tmp_path: Path) -> None:
    model = train_sentencepiece(tmp_path / "spm")
    folder = make_tiny_model(tmp_path / "tiny-mistral", "mistral", seed=9, vocab=330)
    gguf = write_gguf(folder, tmp_path / "tiny-mistral-F32.gguf", "llama", sentencepiece=model)
    from_gguf = generate(gguf, tmp_path / "cache")
    # The same weights in safetensors, read with the tokenizer the conversion built (checked against
    # SentencePiece itself above).
    (converted,) = (tmp_path / "cache" / "models").iterdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted / name, folder / name)
    assert from_gguf.strip() and generate(folder, tmp_path / "cache") == from_gguf


def test_a_gguf_named_on_the_hub_is_served_as_its_safetensors(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "tiny-qwen3", "qwen3", seed=8)
    gguf = write_gguf(folder, tmp_path / "tiny-qwen3-F32.gguf", "qwen3", "qwen2")
    with LocalHub() as hub:
        data = gguf.read_bytes()
        hub.add("org/tiny-GGUF", {"tiny-qwen3-F32.gguf": data, "tiny-qwen3-Q8_0.gguf": b"\0" * 4096})
        env = {
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "NEURON_CACHE_DIR": str(tmp_path / "cache"),
        }
        server = Server("--model", "org/tiny-GGUF:f32", log_path=tmp_path / "serve.log", env=env)
        try:
            expected = generate(folder, tmp_path / "folder-cache")  # while the server starts
            server.start()
            reply = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": "org/tiny-GGUF", "prompt": PROMPT, "max_tokens": 16, "temperature": 0},
                timeout=60,
            ).json()
        finally:
            assert server.stop() == 0, server.stderr()[-3000:]
        assert hub.fetched("org/tiny-GGUF") == ["tiny-qwen3-F32.gguf"]  # the other quantization stays there
    assert reply["choices"][0]["text"] == expected.removesuffix("\n")
    # Its conversion logged as its download did, off a terminal: bytes done of total, then done.
    lines = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if line.startswith("{")]
    fetched = [line for line in lines if line["event"] == "fetched"]
    converted = [line for line in lines if line["event"] == "converting done"]
    assert fetched and converted and converted[0]["bytes_done"] == converted[0]["bytes_total"] > 0


def test_another_architecture_is_refused_by_name(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny-phi3.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    done = run_neuron("generate", "--model", str(path), PROMPT, env={"NEURON_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("neuron: error:")]
    assert "not 'phi3'" in line and "qwen3" in line and "mlx_lm.convert" in line
    assert not any((tmp_path / "cache").rglob("config.json"))  # nothing half-converted left to be taken for whole
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_a_tensor_type_no_decoder_reads_is_refused_naming_those_read(tmp_path: Path) -> None:
    """Every block format is read (tests/e2e/models/test_gguf_kquants.py); an integer tensor is no model's weight."""
    folder = make_tiny_model(tmp_path / "tiny", "llama", seed=7)
    gguf = write_gguf(folder, tmp_path / "tiny-I8.gguf", "llama", quant="I8")
    done = run_neuron(*_generating(gguf), env={"NEURON_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith("neuron: error: tiny-I8.gguf: tensor ") and "is I8, which neuron does not read" in said
    assert "F32, F16, BF16" in said and "K-quants" in said, said
    assert not any((tmp_path / "cache").rglob("config.json"))


def test_a_new_conversion_prunes_the_folders_no_file_will_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache keeps a folder per GGUF file in use: a conversion first deletes those whose file is gone from this
    host (a deleted venv or clone) or that an older converter made, and leaves alone any folder it did not write and
    any another host converted into a shared cache (its file is on that host)."""
    from neuron.models.gguf import CONVERTER_VERSION, converted

    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_tiny_model(tmp_path / "tiny-qwen3", "qwen3", seed=7)
    kept = write_gguf(folder, tmp_path / "kept-F32.gguf", "qwen3", "qwen2")
    gone, later = (shutil.copy(kept, tmp_path / name) for name in ("gone-F32.gguf", "later-F32.gguf"))
    in_use = converted(kept)
    orphan = converted(Path(gone))
    Path(gone).unlink()
    older = shutil.copytree(in_use, in_use.with_name("kept-F32-000000000000"))
    (older / "source.json").write_text(json.dumps({"gguf": str(kept), "converter": CONVERTER_VERSION - 1}))
    elsewhere = shutil.copytree(orphan, orphan.with_name("gone-F32-111111111111"))
    said = json.loads((elsewhere / "source.json").read_text())
    assert said["host"] == socket.gethostname()
    (elsewhere / "source.json").write_text(json.dumps({**said, "host": f"not-{said['host']}"}))
    foreign, unreadable = (tmp_path / "cache" / "models" / name for name in ("mine", "half-written"))
    foreign.mkdir()
    unreadable.mkdir()
    (unreadable / "source.json").write_text("{")
    made = converted(Path(later))
    assert not orphan.exists() and not older.exists()
    assert sorted((tmp_path / "cache" / "models").iterdir()) == sorted([in_use, made, elsewhere, foreign, unreadable])
    assert converted(kept) == in_use and (in_use / "config.json").is_file()
