"""Models by name from the Hugging Face Hub (neuron/models/hub.py), the decisions without a Hub: names and paths,
the GGUF file picked, the token a host is given, a conversion's log lines, a name in the TOML file, where a name
lies in the cache and how a cached model is served. Fetching from a Hub: tests/e2e/models/test_hub.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron.models import hub
from neuron.models.catalog import how_served
from testkit.hub import TOKEN


@pytest.mark.parametrize(
    ("model", "parsed"),
    [
        ("org/name", hub.HubName("org/name")),
        ("org/name@v1.0", hub.HubName("org/name", "v1.0")),
        ("org/name:Q4_K_M", hub.HubName("org/name", None, "Q4_K_M")),
        ("org/name@main:q8_0", hub.HubName("org/name", "main", "q8_0")),
        ("/abs/path", None),
        ("./rel/path", None),
        ("dir/model.gguf", None),
        ("single", None),
        ("a/b/c", None),
        (None, None),
    ],
)
def test_names_and_paths(model: str | None, parsed: hub.HubName | None) -> None:
    assert hub.parse(model) == parsed


def test_gguf_files_picked_as_llama_cpp_does() -> None:
    files = ["a-Q4_K_M.gguf", "a-Q4_K_S.gguf", "a-Q8_0.gguf", "mmproj-a-f16.gguf", "big-Q6_K-00001-of-00002.gguf"]
    name = hub.HubName("org/a", quant="q4_k_m")
    assert hub.to_fetch(name, dict.fromkeys(files, 1), "c").gguf == "a-Q4_K_M.gguf"
    with pytest.raises(hub.HubError, match="split in parts"):
        hub.pick_gguf(hub.HubName("org/a", quant="Q6_K"), files)
    with pytest.raises(hub.HubError, match="GGUF files only"):
        hub.to_fetch(hub.HubName("org/a"), dict.fromkeys(files, 1), "c")


def test_a_host_fetching_by_name_is_given_the_leaders_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert hub.token("org/gated@0123", push=False) == TOKEN
    assert hub.token("org/gated", push=True) == ""  # under --push-model the host never asks the Hub
    assert hub.token(str(tmp_path), push=False) == ""  # a folder: nothing to fetch


def test_a_conversion_logs_its_bytes_at_intervals_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from structlog.testing import capture_logs

    from neuron import log
    from neuron.models import progress
    from neuron.models.progress import Meter

    monkeypatch.setattr(progress, "_bars_drawn", lambda: False)  # as under pytest -s on a terminal too
    try:
        log.configure("info", "json")  # whatever level an earlier test left
        with capture_logs() as logs, Meter("converting", 300, log_every=0) as meter:
            for _ in range(3):
                meter.advance(100)
    finally:
        log.configure("warning", "json")
    assert [(e["event"], e["bytes_done"]) for e in logs] == [("converting", n) for n in (0, 100, 200, 300)] + [
        ("converting done", 300)
    ]
    assert {e["bytes_total"] for e in logs} == {300}


def test_a_name_in_the_toml_file_is_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from neuron.cli.main import _parser
    from neuron.config import sources

    (tmp_path / "neuron.toml").write_text('model = "org/tiny@v1"\n')
    monkeypatch.delenv("NEURON_MODEL", raising=False)
    args = _parser().parse_args(["serve", "--config", str(tmp_path / "neuron.toml")])
    assert sources.resolve(args, "serve") == []
    assert hub.parse(args.model) == hub.HubName("org/tiny", "v1")


def test_a_name_lies_in_the_hugging_face_cache_for_model_dirs() -> None:
    from neuron.models.folder import outside

    assert outside("org/name", str(hub.cache_root().parent)) is None
    problem = outside("org/name", "/srv/models")
    assert problem is not None and "Hugging Face cache" in problem and "HF_HUB_CACHE" in problem


def test_how_a_cached_model_is_served() -> None:
    config = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
    assert how_served(config, "o/n", True) == "yes: --tp 1,3; --pp 2..30"
    gemma = {"model_type": "gemma3_text", "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 6}
    assert how_served(gemma, "o/n", True) == "yes: --tp 1,2,4; --pp 2..6"
    assert how_served({**config, "quantization_config": {"quant_method": "gptq"}}, "o/n", True).startswith("no: ")
    assert how_served(config, "o/n", False).startswith("no: no model*.safetensors")
