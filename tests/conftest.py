"""Shared fixtures: tiny random-weight models with a real tokenizer, the embedded SmolLM2, and helpers.

Tiny models have 4 attention heads and 2 key/value heads, so they split over 1, 2 or 4 ranks.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import httpx
import pytest
from pydantic import BaseModel, Field

from neuron import descriptors

# Test modules import mlx_lm.utils, which would lower this process's hard descriptor limit for good; the
# idle-connection tests open thousands of sockets, and start servers under limits of their own.
descriptors.import_mlx_lm()

ROOT = Path(__file__).resolve().parent.parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A Qwen-style template that renders tools and earlier calls: mlx-lm reads its calls with its json_tools parser.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    'For each call return <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}{% set tool_call = c.function %}<tool_call>"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Trip(BaseModel):
    destination: Address
    stops: list[Address] = Field(max_length=2)
    nights: int = Field(ge=1, le=30)


class Parcel(BaseModel):
    class Address(BaseModel):  # a `$defs` name the other tool uses too, for another shape
        zip: str = Field(pattern="^[0-9]{5}$")

    to: Address


def pydantic_tool(name: str, model: type[BaseModel]) -> dict:
    """A function tool as agent SDKs declare one: parameters from a pydantic model, nested models in `$defs`."""
    return {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}


PLAN_TRIP = pydantic_tool("plan_trip", Trip)
SHIP_PARCEL = pydantic_tool("ship_parcel", Parcel)


def with_template(model: Path, folder: Path, template: str) -> Path:
    """A copy of ``model`` whose tokenizer has another chat template."""
    shutil.copytree(model, folder)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def _tokenizer_files(folder: Path) -> int:
    """A byte-level BPE tokenizer with no merges: every byte is a token. Returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return len(vocab)


def make_tiny_model(
    folder: Path,
    model_type: str,
    seed: int = 0,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    intermediate: int | None = None,
    vocab: int | None = None,
) -> Path:
    """A random-weight model with a real tokenizer; the defaults are the tests' tiny one (the benchmarks grow it)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes

    folder.mkdir(parents=True)
    vocab = max(_tokenizer_files(folder), vocab or 0)  # ids past the tokenizer's are never produced, only computed
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate or hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": model_type == "qwen3",
        "eos_token_id": 2,
    }
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # At default init, greedy decoding of a random model repeats one token; larger
    # matrices make it wander, so that a token-by-token comparison means something.
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from neuron.models import resolve

    return resolve(None)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def neuron_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "neuron", *args]


def run_neuron(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        neuron_command(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class DatagramSink:
    """A Unix datagram socket standing in for systemd's (notify, journal); a thread collects what arrives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.datagrams: list[tuple[float, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.datagrams.append((time.monotonic(), self.sock.recv(1 << 17)))
            except TimeoutError:
                continue

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


os.environ.setdefault("NEURON_LOG_LEVEL", "warning")


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    """A streamed reply's events: each JSON object, and the closing ``[DONE]``."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


TCP_STATES = {"01": "ESTABLISHED", "0A": "LISTEN"}


def tcp_sockets(pid: int) -> list[tuple[str, int, str]]:
    """(local address, local port, state) of every TCP socket the process holds, read from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed since the listing
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # The kernel prints each 32-bit word in host (little-endian) order.
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            out.append((socket.inet_ntop(family, packed), int(port, 16), TCP_STATES.get(fields[3], fields[3])))
    return out


class Server:
    """A real ``neuron serve`` subprocess on a free port; its log (JSON lines) lands in a file.

    With ``listen``, the server is socket-activated as systemd does it: the
    socket becomes its file descriptor 3, with ``LISTEN_PID`` and ``LISTEN_FDS``.
    """

    def __init__(
        self,
        *args: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        listen: socket.socket | None = None,
        nofile: tuple[int, int] | None = None,
    ):
        self.log_path = log_path
        self.args = args
        self.api_key = api_key
        self._log = open(log_path, "w")
        extra = ("--api-key", api_key) if api_key else ()
        command = neuron_command("serve", "--port", "0", "--log-level", "info", *extra, *args)
        fd = None
        if listen is not None:
            # LISTEN_PID must be the server's own pid, known only in the child: a shell sets it, then execs.
            command = ["sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" "$@"', *command]
            fd = listen.fileno()

        def setup() -> None:
            if fd is not None:
                os.dup2(fd, 3)  # the new descriptor is inheritable
            if nofile is not None:  # the descriptor limit an operator (systemd's LimitNOFILE=) would give
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            preexec_fn=setup if fd is not None or nofile is not None else None,
            close_fds=listen is None,
        )
        self.port = 0

    def logs(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def find_log(self, event: str, **fields: object) -> dict | None:
        for entry in self.logs():
            if entry.get("event") == event and all(entry.get(k) == v for k, v in fields.items()):
                return entry
        return None

    def wait_log(self, event: str, timeout: float = 120, **fields: object) -> dict:
        found: list[dict] = []

        def seen() -> bool:
            if (entry := self.find_log(event, **fields)) is not None:
                found.append(entry)
                return True
            assert self.process.poll() is None, f"neuron serve exited {self.process.returncode}:\n{self.stderr()}"
            return False

        wait_until(seen, timeout, f"log event {event!r} {fields}")
        return found[0]

    def start(self) -> Server:
        self.port = self.wait_log("serving")["port"]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.log_path.read_text()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """/metrics scraped: (name, sorted labels) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        response = httpx.get(f"{self.url}/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples
        }

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._log.close()


@contextmanager
def serving(tmp_path_factory: pytest.TempPathFactory, *args: str, **kwargs: object) -> Iterator[Server]:
    """A started server, stopped on exit; it must exit 0 on SIGTERM."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = Server(*args, log_path=log, **kwargs)  # type: ignore[arg-type]
    try:
        yield server.start()
    finally:
        rc = server.stop()
    assert rc == 0, server.stderr()


@pytest.fixture(
    scope="module",
    params=[("--tp", "1"), ("--tp", "2"), ("--pp", "2", "--micro-batches", "2")],
    ids=["tp1", "tp2", "pp2"],
)
def split_qwen3(
    request: pytest.FixtureRequest, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The tiny qwen3 served three ways, one server per module: one rank; every layer sliced over two; two
    pipeline stages, whose decode runs in two micro-batches. Prompts are fed 16 tokens a step, so that long ones
    take several steps."""
    with serving(tmp_path_factory, "--model", str(tiny_models["qwen3"]), "--prefill-chunk", "16", *request.param) as s:
        yield s


# A Qwen3-style thinking model: `<think>` and `</think>` are tokens of its own (added, not special, as Qwen3's), its
# template renders tools and opens the thinking section for the model unless `enable_thinking` is false.
THINKING_TEMPLATE = TOOLS_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}",
)


def make_thinking_model(folder: Path) -> Path:
    """A tiny qwen3 whose tokenizer has thinking markers and whose template thinks (THINKING_TEMPLATE)."""
    from tokenizers import AddedToken, Tokenizer

    make_tiny_model(folder, "qwen3", seed=3, vocab=len(SPECIALS) + 256 + 8)  # room for the two markers
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    return folder


@pytest.fixture(scope="session")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The thinking model served on one rank, for the whole session (reasoning and the Messages API share it)."""
    model = make_thinking_model(tmp_path_factory.mktemp("thinking") / "tiny-thinker")
    with serving(tmp_path_factory, "--model", str(model), "--prefill-chunk", "64") as server:
        yield server
