"""What a model folder or a host may not do: run code, unpickle, escape the allowed directories, listen off-host."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit import Server, run_neuron, serving, tcp_sockets


class _Planted:
    """Unpickling this creates a file: proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.marker), "w")


def _plant_code(folder: Path, marker: Path) -> None:
    (folder / "planted.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class Planted(PreTrainedTokenizerFast):\n    pass\n"
    )


@pytest.fixture
def model_copy(tiny_models: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_models["qwen3"], tmp_path / "qwen3"))


def test_a_model_outside_the_allowed_directories_is_refused_even_through_a_symlink(
    model_copy: Path, tmp_path: Path
) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link").symlink_to(model_copy)
    # A bad port rides along, so that a server that wrongly accepts the model still exits at once, with usage.
    refused = run_neuron(
        "serve", "--model", str(allowed / "link"), "--model-dirs", f"/nonexistent:{allowed}", "--port", "70000"
    )
    assert refused.returncode == 2
    assert f"--model {model_copy} lies outside the allowed model directories" in refused.stderr
    # Inside, the model passes this check: the only problem left is the port, given wrong on purpose.
    shutil.move(model_copy, allowed / "qwen3")
    inside = run_neuron(
        "serve", "--model", str(allowed / "qwen3"), "--port", "70000", env={"NEURON_MODEL_DIRS": str(allowed)}
    )
    assert inside.returncode == 2 and "--port" in inside.stderr and "allowed" not in inside.stderr, inside.stderr
    relative = run_neuron("serve", "--model", str(allowed / "qwen3"), "--model-dirs", "models")
    assert relative.returncode == 2 and "absolute" in relative.stderr


def test_a_model_that_needs_its_own_code_is_refused_and_the_code_never_runs(model_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    _plant_code(model_copy, marker)
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "model_file": "planted.py"}))
    result = run_neuron("generate", "--model", str(model_copy), "hi", "--max-tokens", "2")
    assert result.returncode == 1 and "never runs code shipped with a model" in result.stderr, result.stderr
    assert not marker.exists()


def test_a_tokenizer_that_names_its_own_class_loads_without_running_it(model_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    _plant_code(model_copy, marker)
    settings = json.loads((model_copy / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": ["planted.Planted", "planted.Planted"]}
    (model_copy / "tokenizer_config.json").write_text(json.dumps(settings))
    result = run_neuron("generate", "--model", str(model_copy), "hi", "--max-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert not marker.exists()


def test_pickled_weights_are_refused_unopened(model_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    (model_copy / "model.safetensors").unlink()
    (model_copy / "pytorch_model.bin").write_bytes(pickle.dumps(_Planted(marker)))
    result = run_neuron("generate", "--model", str(model_copy), "hi", "--max-tokens", "2")
    assert result.returncode == 1 and "safetensors or GGUF only" in result.stderr, result.stderr
    assert not marker.exists()


@pytest.fixture(scope="module")
def tp2(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory, "--model", str(tiny_models["qwen3"]), "--tp", "2") as server:
        yield server


def test_every_socket_of_every_rank_stays_on_loopback(tp2: Server) -> None:
    worker = next(e["pid"] for e in tp2.logs() if e.get("event") == "worker started")
    for pid in (tp2.process.pid, worker):
        sockets = tcp_sockets(pid)
        # The ring joins the ranks over TCP (its listeners close once the links are made).
        assert any(state == "ESTABLISHED" for _, _, state in sockets), sockets
        assert all(address == "127.0.0.1" for address, _, _ in sockets), (pid, sockets)
    assert ("127.0.0.1", tp2.port, "LISTEN") in tcp_sockets(tp2.process.pid)
    # Bound to loopback (the default), nothing is open to other machines: no warning.
    assert tp2.find_log("open to the network") is None


def test_a_server_bound_beyond_loopback_without_a_key_says_what_is_open_and_how_to_close_it(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    server = Server("--model", str(tiny_models["qwen3"]), "--host", "0.0.0.0", log_path=tmp_path / "serve.log")
    try:
        server.start()  # serving, so that the stop below is the graceful one (a signal in the first milliseconds
        # after the socket is bound, before the handlers are in place, ends the process as SIGTERM's default does)
        warned = server.find_log("open to the network")
        assert warned is not None
        assert warned["level"] == "warning" and warned["host"] == "0.0.0.0" and warned["port"] == server.port
        assert "generate with the model" in warned["open"] and "loopback clients only" in warned["open"]
        assert "--api-key" in warned["fix"] and "127.0.0.1" in warned["fix"]
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]
