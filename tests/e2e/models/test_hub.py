"""Models by name from the Hugging Face Hub (neuron/models/hub.py), fetched by the real ``huggingface_hub`` client
from a local server speaking the Hub's protocol (testkit/hub.py): serve and generate by name, offline starts, pinned
revisions, a cut download resumed, gated repositories, refusals before any weight is fetched, the one-line errors,
``neuron pull`` / ``models`` / ``models rm``, and the progress a person sees. The decisions without a Hub:
tests/unit/models/test_hub.py."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit import Server, make_tiny_model, neuron_command, run_neuron, run_neuron_side_by_side, wait_until
from testkit.hub import TOKEN, LocalHub, hub_env

PROMPT = "The hub"
CHUNK = 10 * 1024 * 1024  # what huggingface_hub reads and writes at a time
OTHER_TOKEN = "hf_not_granted"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-models")
    # Weights past huggingface_hub's 10 MiB read size, so that a download reports progress and can be cut midway.
    first = make_tiny_model(root / "first", "qwen3", seed=1, hidden=512)
    second = make_tiny_model(root / "second", "qwen3", seed=2, hidden=512)
    return {"first": first, "second": second}


@pytest.fixture(scope="module")
def local_hub(folders: dict[str, Path]) -> Iterator[LocalHub]:
    with LocalHub() as server:
        server.tokens = {TOKEN, OTHER_TOKEN}
        # Files neuron must never fetch sit beside the ones it reads.
        extras = {"pytorch_model.bin": b"\0" * 4096, "consolidated.safetensors": b"\0" * 4096, "README.md": b"# tiny"}
        first = {p.name: p.read_bytes() for p in folders["first"].iterdir()} | extras
        second = {p.name: p.read_bytes() for p in folders["second"].iterdir()} | extras
        server.add("org/tiny", first, tags=("v1",))
        server.add("org/tiny", second)  # main moves on; v1 stays on the first commit
        server.add("org/gated", folders["first"], token=TOKEN)
        config = (folders["first"] / "config.json").read_bytes()
        server.add("org/torch-only", {"config.json": config, "pytorch_model.bin": b"\0" * 4096})
        alien = json.dumps({**json.loads(config), "model_type": "made_up_arch"}).encode()
        server.add("org/alien", {"config.json": alien, "model.safetensors": b"\0" * 4096})
        server.add("org/ggufs", {"tiny-Q8_0.gguf": b"\0" * 4096, "tiny-Q4_K_M.gguf": b"\0" * 4096})
        yield server


def _generating(model: str, *args: str) -> tuple[str, ...]:
    return ("generate", "--model", model, "--max-tokens", "12", *args, PROMPT)


def generate(model: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_neuron(*_generating(model, *args), env=env, timeout=180)


def generate_side_by_side(env: dict[str, str], *models: str) -> list[subprocess.CompletedProcess[str]]:
    """``generate`` for each model, run side by side."""
    return run_neuron_side_by_side(*map(_generating, models), env=env, timeout=180)


def one_line_error(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("neuron: error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in errors[0], errors[0]


def test_generate_by_name_fetches_only_what_neuron_reads_and_equals_the_folder(
    local_hub: LocalHub, folders: dict[str, Path], tmp_path: Path
) -> None:
    local_hub.requests.clear()
    by_name, from_folder = generate_side_by_side(
        hub_env(local_hub, tmp_path / "hf"), "org/tiny", str(folders["second"])
    )
    assert by_name.returncode == 0, by_name.stderr
    assert by_name.stdout == from_folder.stdout and by_name.stdout.strip()
    assert sorted(local_hub.fetched("org/tiny")) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # Offline, the Hub stopped (nothing listens at HF_ENDPOINT): the cache alone serves it; and, not cached, one is
    # refused at once, saying what to do (the two side by side: the time bounds the slower).
    started = time.monotonic()
    offline, missing = generate_side_by_side(
        hub_env(None, tmp_path / "hf", HF_HUB_OFFLINE="1"), "org/tiny", "org/gated"
    )
    assert time.monotonic() - started < 60
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == by_name.stdout
    one_line_error(missing, "org/gated is not in the Hugging Face cache", "HF_HUB_OFFLINE", "neuron pull")
    # Not told to stay offline, the Hub out of reach: the cache serves it all the same.
    unreachable = generate("org/tiny", hub_env(None, tmp_path / "hf"))
    assert unreachable.returncode == 0, unreachable.stderr
    assert unreachable.stdout == by_name.stdout


def test_revisions_pinned_by_tag_and_by_commit(local_hub: LocalHub, folders: dict[str, Path], tmp_path: Path) -> None:
    env = hub_env(local_hub, tmp_path / "hf")
    first_commit = local_hub.repos["org/tiny"].refs["v1"]
    second_commit = local_hub.repos["org/tiny"].refs["main"]
    # Side by side, the two revisions fetched into one cache at once (its shared files are locked per file).
    by_tag, by_commit, first, second = generate_side_by_side(
        env, "org/tiny@v1", f"org/tiny@{second_commit}", str(folders["first"]), str(folders["second"])
    )
    assert by_tag.returncode == 0 and by_commit.returncode == 0, by_tag.stderr + by_commit.stderr
    assert by_tag.stdout == first.stdout and by_commit.stdout == second.stdout
    assert by_tag.stdout != by_commit.stdout
    snapshots = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots"
    assert sorted(p.name for p in snapshots.iterdir()) == sorted([first_commit, second_commit])
    one_line_error(generate("org/tiny@v9", env), "has no revision 'v9'", "leave @REVISION off")


def test_serve_by_name_shows_progress_on_ready_and_counts_bytes(
    local_hub: LocalHub, folders: dict[str, Path], tmp_path: Path
) -> None:
    local_hub.rate = 6_000_000  # bytes a second: the weights take a few seconds
    env = hub_env(local_hub, tmp_path / "hf")
    server = None
    try:
        log = tmp_path / "serve.log"
        # Named in the environment, as a unit file would (the TOML file and --model take it alike).
        server = Server(log_path=log, env={**env, "NEURON_MODEL": "org/tiny@v1"})
        port = server.wait_log("listening")["port"]
        seen: list[dict] = []

        def downloading() -> bool:
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
            except httpx.TransportError:
                return False
            body = reply.json()
            if reply.status_code == 503 and body.get("download", {}).get("bytes_done", 0) > 0:
                seen.append(body)
                return True
            return False

        wait_until(downloading, 60, "/ready to show the download's progress")
        progress = seen[0]["download"]
        assert progress["model"] == "org/tiny@v1" and CHUNK <= progress["bytes_done"] < progress["bytes_total"]
        assert "fetching org/tiny@v1" in seen[0]["error"]["message"]
        local_hub.rate = None  # the progress showed: the rest of the weights at once
        server.start()
        completion = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "org/tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
            timeout=60,
        ).json()
        weights = (folders["first"] / "model.safetensors").stat().st_size
        assert server.metrics()[("neuron_hub_bytes_total", ())] >= weights
    finally:
        local_hub.rate = None
        if server is not None:
            assert server.stop() == 0
    assert completion["model"] == "org/tiny"
    from_folder = generate(str(folders["first"]), env)
    assert completion["choices"][0]["text"] == from_folder.stdout.removesuffix("\n")


def test_a_download_killed_midway_resumes(local_hub: LocalHub, tmp_path: Path) -> None:
    local_hub.rate = 4_000_000
    env = {**os.environ, **hub_env(local_hub, tmp_path / "hf")}
    blobs = tmp_path / "hf" / "hub" / "models--org--tiny" / "blobs"
    pull = subprocess.Popen(neuron_command("pull", "org/tiny"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:

        def part_arrived() -> bool:
            assert pull.poll() is None, pull.communicate()
            parts = list(blobs.glob("*.incomplete")) if blobs.is_dir() else []
            return any(p.stat().st_size >= CHUNK for p in parts)

        wait_until(part_arrived, 60, "a part of the weights to arrive")
    finally:
        pull.send_signal(signal.SIGKILL)
        pull.communicate()
        local_hub.rate = None
    # No half file under a final name: the weights are only an .incomplete blob.
    assert not list((tmp_path / "hf" / "hub" / "models--org--tiny").rglob("model.safetensors"))
    assert [p.name.endswith(".incomplete") for p in blobs.iterdir() if p.stat().st_size >= CHUNK] == [True]
    offline = generate("org/tiny", hub_env(None, tmp_path / "hf", HF_HUB_OFFLINE="1"))
    one_line_error(offline, "is not in the Hugging Face cache")
    local_hub.requests.clear()
    again = run_neuron("pull", "org/tiny", env=hub_env(local_hub, tmp_path / "hf"))
    assert again.returncode == 0, again.stderr
    ranges = local_hub.ranges("org/tiny", "model.safetensors")
    assert len(ranges) == 1 and ranges[0] is not None and int(ranges[0].split("=")[1].split("-")[0]) >= CHUNK
    assert (Path(again.stdout.strip()) / "model.safetensors").is_file()


def test_gated_without_then_with_a_token(local_hub: LocalHub, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    local_hub.requests.clear()
    one_line_error(run_neuron("pull", "org/gated", env=hub_env(local_hub, home)), "org/gated is gated", "HF_TOKEN")
    one_line_error(run_neuron("pull", "org/gated", env=hub_env(local_hub, home, HF_TOKEN=OTHER_TOKEN)), "has no access")
    one_line_error(
        run_neuron("pull", "org/gated", env=hub_env(local_hub, home, HF_TOKEN="hf_mistyped")),
        "refused the token",
    )
    assert local_hub.fetched("org/gated") == []
    granted = run_neuron("pull", "org/gated", env=hub_env(local_hub, home, HF_TOKEN=TOKEN))
    assert granted.returncode == 0, granted.stderr
    assert "model.safetensors" in local_hub.fetched("org/gated")


def test_a_model_another_tool_fetched_is_used_where_it_lies(local_hub: LocalHub, tmp_path: Path) -> None:
    env = hub_env(local_hub, tmp_path / "hf")
    hf = Path(sys.executable).with_name("hf")  # huggingface_hub's own CLI, as mlx-lm and LM Studio fetch alike
    done = subprocess.run([str(hf), "download", "org/tiny"], env={**os.environ, **env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    blobs = tmp_path / "hf" / "hub" / "models--org--tiny" / "blobs"
    before = sorted(blobs.iterdir())
    local_hub.requests.clear()
    pulled = run_neuron("pull", "org/tiny", env=env)
    assert pulled.returncode == 0, pulled.stderr
    snapshot = blobs.parent / "snapshots" / local_hub.repos["org/tiny"].refs["main"]
    assert Path(pulled.stdout.strip()) == snapshot  # the folder hf download filled
    assert local_hub.fetched("org/tiny") == [] and sorted(blobs.iterdir()) == before  # nothing fetched or stored twice


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("org/torch-only", ["no model*.safetensors weights", "pytorch_model.bin"]),
        ("org/alien", ["'made_up_arch'", "neither neuron nor mlx-lm"]),
        ("org/ggufs", ["GGUF files only", "org/ggufs:QUANT", "Q4_K_M, Q8_0"]),
        ("org/ggufs:Q5_K", ["no GGUF file for 'Q5_K'"]),
        ("org/missing", ["not on the Hub", "check the name"]),
    ],
)
def test_refused_before_any_weight_is_fetched(
    local_hub: LocalHub, tmp_path: Path, model: str, words: list[str]
) -> None:
    local_hub.requests.clear()
    one_line_error(run_neuron("pull", model, env=hub_env(local_hub, tmp_path / "hf")), *words)
    assert set(local_hub.fetched(model.split(":")[0])) <= {"config.json"}


def test_no_network_and_a_full_disk(local_hub: LocalHub, tmp_path: Path) -> None:
    one_line_error(
        run_neuron("pull", "org/tiny", env=hub_env(None, tmp_path / "hf")), "cannot be reached", "neuron pull"
    )
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        full = run_neuron("pull", "org/tiny", env=hub_env(local_hub, disk / "hf"))
        one_line_error(full, "no space left", "the next start resumes")
        snapshot = disk / "hf" / "hub" / "models--org--tiny" / "snapshots"
        assert not list(snapshot.rglob("model.safetensors"))
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_pull_models_and_rm(local_hub: LocalHub, tmp_path: Path) -> None:
    env = hub_env(local_hub, tmp_path / "hf")
    assert run_neuron("pull", "org/tiny@v1", env=env).returncode == 0
    assert run_neuron("pull", "org/tiny", env=env).returncode == 0
    listed = run_neuron("models", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    entries = [json.loads(line) for line in listed.stdout.splitlines()]
    assert {e["revision"] for e in entries} == set(local_hub.repos["org/tiny"].refs.values())
    for entry in entries:
        assert entry["name"] == "org/tiny" and entry["architecture"] == "qwen3"
        assert entry["bytes"] > 1_000_000 and entry["serves"] == "yes: --tp 1,2; --pp 2..4"
    assert {r for e in entries for r in e["refs"]} == {"main", "v1"}
    table = run_neuron("models", env=env).stdout
    assert "org/tiny" in table and "(v1)" in table and "qwen3" in table
    removed = run_neuron("models", "rm", "org/tiny@v1", env=env)
    assert removed.returncode == 0 and "freed" in removed.stdout, removed.stderr
    assert [json.loads(line)["refs"] for line in run_neuron("models", "--json", env=env).stdout.splitlines()] == [
        ["main"]
    ]
    assert run_neuron("models", "rm", "org/tiny", env=env).returncode == 0
    assert "no models" in run_neuron("models", env=env).stdout
    one_line_error(run_neuron("models", "rm", "org/tiny", env=env), "not in the Hugging Face cache")


def test_progress_bar_on_a_terminal_and_log_lines_when_piped(local_hub: LocalHub, tmp_path: Path) -> None:
    local_hub.rate = 8_000_000
    try:
        # The two pulls side by side (each mostly waits on the throttled Hub): one into a pipe, one on a terminal.
        with (tmp_path / "piped.err").open("w+") as piped_err:
            piped = subprocess.Popen(
                neuron_command("pull", "org/tiny"),
                env={**os.environ, **hub_env(local_hub, tmp_path / "piped")},
                stdout=subprocess.DEVNULL,
                stderr=piped_err,
            )
            try:
                seen = _pull_on_a_terminal(local_hub, tmp_path / "tty")
                assert piped.wait(60) == 0
            finally:
                piped.kill()  # where a wait ran out; nothing once it exited
                piped.wait()
            piped_err.seek(0)
            said = piped_err.read()
    finally:
        local_hub.rate = None
    assert piped.returncode == 0, said
    lines = [json.loads(line) for line in said.splitlines() if line.startswith("{")]
    fetching = [line for line in lines if line["event"] == "fetching" and "bytes_done" in line]
    assert fetching and all(0 <= line["bytes_done"] <= line["bytes_total"] for line in fetching)
    assert lines[-1]["event"] == "fetched" and lines[-1]["bytes_done"] >= 1_000_000
    assert "%|" not in said  # no bar drawn into a pipe
    text = seen.decode(errors="replace")
    assert "%|" in text and "B/s" in text, text  # tqdm's bar: percent, bytes, rate (and time left)


def _pull_on_a_terminal(local_hub: LocalHub, home: Path) -> bytes:
    """What ``neuron pull org/tiny`` drew on a terminal (a pty), once it exited 0."""
    controller, terminal = pty.openpty()
    # A terminal has a size (a fresh pty's is 0 x 0, where tqdm draws nothing): 24 rows, 120 columns.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = {**os.environ, **hub_env(local_hub, home)}
    on_tty = subprocess.Popen(
        neuron_command("pull", "org/tiny"), env=env, stdout=subprocess.PIPE, stderr=terminal, stdin=terminal
    )
    os.close(terminal)
    seen = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    assert on_tty.wait(60) == 0
    os.close(controller)
    return seen


def test_a_signal_during_the_download_stops_the_server_and_the_next_start_resumes(
    local_hub: LocalHub, tmp_path: Path
) -> None:
    local_hub.rate = 4_000_000
    env = hub_env(local_hub, tmp_path / "hf")
    server = Server("--model", "org/tiny", log_path=tmp_path / "serve.log", env=env)
    try:
        port = server.wait_log("listening")["port"]

        def midway() -> bool:
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).json()
            except httpx.TransportError:
                return False
            return body.get("download", {}).get("bytes_done", 0) >= CHUNK

        wait_until(midway, 60, "the weights to be half fetched")
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(20) == 0, server.stderr()[-3000:]
        assert time.monotonic() - started < 5
    finally:
        server.stop()
        local_hub.rate = None
    # What reached the disk, which the progress (counted as bytes arrive) may be ahead of: the next start asks for
    # the rest of it, not for the file again.
    (part,) = (tmp_path / "hf" / "hub" / "models--org--tiny" / "blobs").glob("*.incomplete")
    kept = part.stat().st_size
    assert kept > 0
    local_hub.requests.clear()
    again = run_neuron("pull", "org/tiny", env=env)
    assert again.returncode == 0, again.stderr
    (resumed,) = local_hub.ranges("org/tiny", "model.safetensors")
    assert resumed == f"bytes={kept}-"
