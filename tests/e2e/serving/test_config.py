"""Settings from a file, as ``neuron serve`` takes them: a bad value refused before anything loads, a good file's
limits served. The resolution itself (file < environment < flags): tests/unit/config/test_config.py."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from testkit import Server, run_neuron


def test_serve_refuses_a_bad_file_before_loading_anything(tmp_path: Path) -> None:
    file = tmp_path / "neuron.toml"
    file.write_text('model = "/no/such/model"\nmax_batch = -2\n')
    started = time.monotonic()
    done = run_neuron("serve", "--config", str(file))
    assert done.returncode == 2
    assert f"max_batch in {file} must be at least 1, got -2" in done.stderr
    assert "does not exist" not in done.stderr  # the model path was never looked at
    assert time.monotonic() - started < 20


def test_serve_takes_its_settings_from_the_file(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    file = tmp_path / "neuron.toml"
    file.write_text(f'model = "{tiny_models["qwen3"]}"\nmax_batch = 1\nmax_waiting = 0\n')
    server = Server("--config", str(file), log_path=tmp_path / "log").start()
    try:
        assert server.find_log("listening", model="qwen3") is not None
        body = {"model": "qwen3", "prompt": "hello", "max_tokens": 300, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as first:
            next(first.iter_lines())
            # One place in the batch and none in the queue, as the file says: a second request is refused.
            second = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=60)
            assert second.status_code == 429
    finally:
        assert server.stop() == 0
