"""The page at ``/`` in a real browser: the system's Chromium driven by Playwright, every request to another host
blocked. The page loads; a chat streams a reply from the embedded model (SmolLM2); a thinking model's reasoning is
shown folded; Stop cancels the request on the server; the cluster view of a tiny model over two ranks (TP=2) shows
both ranks and their memory read live, marks a killed worker as lost, then as recovered. One server of each for the
module.

Screenshots are kept under the module's pytest temporary folder (their paths are printed) and in
``artifacts/page/`` (git ignores it), for CI to upload. Without Chromium or Playwright these tests skip,
saying which is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from testkit import ROOT, Server, serving
from testkit.resume import worker_pid
from testkit.server import wait_until

CHROMIUM = os.environ.get("NEURON_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000
KEY = "sk-browser-test"


def _missing() -> str | None:
    if not Path(CHROMIUM).is_file():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set NEURON_CHROMIUM)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install -e '.[test]')"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


@pytest.fixture(scope="module")
def servers(
    smollm2: Path, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    """Started side by side (a start is mostly one process importing): the embedded model, for the chat, behind an
    API key the browser is asked for (HTTP Basic); the tiny qwen3 over two ranks, one of which the last test
    kills; and the tiny llama over two ranks that a hostfile pins to one core. Each must exit 0 on SIGTERM."""
    folder = tmp_path_factory.mktemp("serve")
    one_core = [{"ssh": "localhost", "ips": ["127.0.0.1"], "cpus": [0]}] * 2
    (folder / "one-core.json").write_text(json.dumps({"hosts": one_core}))
    started = {
        "chat": Server("--model", str(smollm2), log_path=folder / "chat.log", api_key=KEY),
        "cluster": Server(
            "--model", str(tiny_models["qwen3"]), "--tp", "2", "--step-timeout", "5", log_path=folder / "cluster.log"
        ),
        "crowded": Server(
            *("--model", str(tiny_models["llama"]), "--hosts", str(folder / "one-core.json")),
            log_path=folder / "crowded.log",
        ),
    }
    try:
        yield {name: server.start() for name, server in started.items()}
    finally:
        codes = {name: server.stop() for name, server in started.items()}
    for name, rc in codes.items():
        assert rc == 0, started[name].stderr()


@pytest.fixture(scope="module")
def chat_server(servers: dict[str, Server]) -> Server:
    return servers["chat"]


@pytest.fixture(scope="module")
def cluster(servers: dict[str, Server]) -> Server:
    return servers["cluster"]


@pytest.fixture(scope="module")
def crowded(servers: dict[str, Server]) -> Server:
    return servers["crowded"]


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("page-screenshots")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            args=ARGS,
            viewport={"width": 1280, "height": 800},
            # What a person types into the browser's dialog when the keyed server's page asks for the key.
            http_credentials={"username": "operator", "password": KEY},
        )
        context.set_default_timeout(TIMEOUT_MS)
        browser = Browser(context)
        context.route("**/*", browser.only_the_servers)
        yield browser
        context.close()
    assert not browser.blocked, f"the page asked for other hosts: {browser.blocked}"
    assert not browser.errors, f"the page's script failed or was refused (CSP): {browser.errors}"


class Browser:
    """One Chromium profile; each server's page in a tab of its own, every request elsewhere refused."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.servers: list[str] = []
        self.blocked: list[str] = []
        self.errors: list[str] = []

    def only_the_servers(self, route: Any) -> None:
        if any(route.request.url.startswith(url + "/") for url in self.servers):
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort()

    def open(self, server: Server) -> Any:
        self.servers.append(server.url)
        page = self.context.new_page()
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        # A refused call (a 401 among them: the browser did not resend the key) is a console error.
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.goto(server.url + "/")
        page.wait_for_selector("#readiness.ready")
        return page


@pytest.fixture(scope="module")
def chat(browser: Browser, chat_server: Server) -> Any:
    return browser.open(chat_server)


def shoot(page: Any, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    kept = ROOT / "artifacts" / "page"
    kept.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, kept / path.name)
    print(f"screenshot: {path}")
    return path


def cancelled(server: Server) -> float:
    return server.metrics().get(("neuron_requests_total", (("outcome", "cancelled"),)), 0.0)


def send(page: Any, text: str, max_tokens: int, temperature: float | None = None) -> Any:
    page.locator("#settings").evaluate("details => { details.open = true; }")
    page.fill("#max-tokens", str(max_tokens))
    if temperature is not None:
        page.fill("#temperature", str(temperature))
    page.fill("#prompt", text)
    page.click("#send")
    return page.locator(".message.assistant").last


def test_the_page_loads_and_shows_the_model(chat: Any, chat_server: Server, shots: Path) -> None:
    assert chat.locator("#key-form").is_hidden(), "the page's own calls passed with the browser's Basic credentials"
    assert httpx.get(chat_server.url + "/").status_code == 401, "the page sits behind the key"
    for storage in ("localStorage", "sessionStorage"):
        assert KEY not in str(chat.evaluate(f"JSON.stringify({storage})")), f"the key is in {storage}"
    assert KEY not in chat.content()
    assert chat.locator("#model-name").text_content() == chat_server.find_log("serving")["model"]
    assert chat.locator("#attach-label").is_hidden(), "the model takes no images: no attach button"
    shoot(chat, shots, "loaded")


def test_a_chat_streams_a_reply_from_the_embedded_model(chat: Any, chat_server: Server, shots: Path) -> None:
    chat.click("#new-chat")
    reply = send(chat, "What is the capital of France?", 24)
    wait_until(lambda: bool(reply.locator(".content").text_content()), 60, "the first words of the reply")
    words = reply.locator(".content").text_content()
    chat.wait_for_selector(".message.assistant[data-done=done]")
    assert reply.locator(".content").text_content().startswith(words), "the reply grew as it streamed"
    assert reply.locator(".error").count() == 0, reply.text_content()
    assert reply.locator("details.reasoning").is_hidden(), "SmolLM2 does not reason"
    chat.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=chat_server.url)
    reply.locator("button.copy").click()
    chat.wait_for_selector(".message.assistant button.copy:text('Copied')")
    assert chat.evaluate("navigator.clipboard.readText()") == reply.locator(".content").text_content()
    chat.reload()  # the conversation was kept in the browser
    chat.wait_for_selector("#readiness.ready")
    assert chat.locator(".message.user .content").last.text_content() == "What is the capital of France?"
    assert chat.locator(".message.assistant .content").last.text_content()
    shoot(chat, shots, "chat")


def test_reasoning_is_shown_folded(browser: Browser, thinking_server: Server, shots: Path) -> None:
    page = browser.open(thinking_server)
    reply = send(page, "Think first", 16)
    page.wait_for_selector(".message.assistant[data-done=done]")
    folded = reply.locator("details.reasoning")
    assert folded.is_visible() and folded.get_attribute("open") is None
    assert not reply.locator("details.reasoning > div").is_visible(), "the reasoning is folded"
    folded.locator("summary").click()
    assert reply.locator("details.reasoning > div").text_content(), "no reasoning streamed"
    shoot(page, shots, "reasoning")
    page.close()


def test_stop_cancels_the_request_on_the_server(chat: Any, chat_server: Server) -> None:
    page, server = chat, chat_server
    before = cancelled(server)
    page.click("#new-chat")
    # Greedy, on a prompt whose greedy reply runs past the limit: a sampled reply could end before the click.
    reply = send(page, "Write the numbers from 1 to 500, separated by commas.", 1900, temperature=0)
    wait_until(lambda: bool(reply.locator(".content").text_content()), 60, "the first words of the reply")
    # Pressed from the page's own script, once the page has enabled it: in the whole suite a mouse click, which
    # waits for the button to hold still over two painted frames, landed only tens of seconds into the reply.
    wait_until(lambda: page.locator("#stop").is_enabled(), 60, "the Stop button enabled")
    page.evaluate("document.getElementById('stop').click()")
    page.wait_for_selector(".message.assistant[data-done=stopped]")
    wait_until(lambda: cancelled(server) > before, 60, "the server to count the request cancelled")
    assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()


def test_the_cluster_shows_both_ranks_and_a_lost_worker_recovered(
    browser: Browser, cluster: Server, shots: Path
) -> None:
    page, server = browser.open(cluster), cluster
    page.click("#tab-cluster")
    ranks = page.locator(".rank")
    page.wait_for_selector('.rank[data-rank="1"][data-state=ok]')
    assert ranks.count() == 2
    assert "layers" in page.locator('.rank[data-rank="0"]').text_content()
    status = httpx.get(f"{server.url}/v1/status").json()
    document = httpx.get(f"{server.url}/openapi.json").json()
    schema = document["paths"]["/v1/status"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    jsonschema.validate(status, {**schema, "components": document["components"]})
    body = {"model": status["model"]["id"], "prompt": "Hello", "max_tokens": 8}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    recent = httpx.get(f"{server.url}/v1/status").json()["recent"]
    assert sum(tokens for *_, tokens in recent) >= 7 and all(steps >= 1 for _, steps, _, _ in recent), recent
    assert page.locator("#chart-step polyline").get_attribute("points")
    assert [r["rank"] for r in status["ranks"]] == [0, 1] and status["model"]["architecture"]["model_type"] == "qwen3"
    # Each rank's memory, read live during the steps (a worker's rides on its step reply) and shown on the page.
    for rank in httpx.get(f"{server.url}/v1/status").json()["ranks"]:
        assert rank["used_bytes"] > 0 and rank["free_bytes"] > 0 and rank["memory_read_at"] > 0, rank
    page.wait_for_selector('.rank[data-rank="1"] dt:text("memory used (read")')
    shoot(page, shots, "cluster")
    os.kill(worker_pid(server), signal.SIGKILL)
    # The card shows the loss while the recovery runs; one that takes less than a poll's interval (a few hundred
    # ms on an idle machine) leaves no poll to see it, and the card goes straight to recovered, which it shows only
    # after a loss of that rank. The events list keeps the loss either way.
    page.wait_for_selector('.rank[data-rank="1"][data-state=lost], .rank[data-rank="1"][data-state=recovered]')
    page.wait_for_selector("#events li.lost")
    shoot(page, shots, "cluster-lost")
    page.wait_for_selector('.rank[data-rank="1"][data-state=recovered]', timeout=180_000)
    page.wait_for_selector("#events li.recovered")
    assert page.locator('.rank[data-rank="0"]').get_attribute("data-state") == "ok"
    shoot(page, shots, "cluster-recovered")


def test_ranks_that_share_a_core_are_warned_of_at_start_and_on_the_page(
    browser: Browser, crowded: Server, shots: Path
) -> None:
    """Two ranks a hostfile pins to core 0 take turns on it: the leader serves them, and says so where an operator
    looks (the log, ``/v1/status``, the page) with what to change."""
    said = crowded.find_log("ranks outnumber cores")
    assert said is not None and said["level"] == "warning", said
    assert (said["host"], said["ranks"], said["cores"]) == ("localhost", [0, 1], 1), said
    assert "place at most 1 there" in said["advice"], said
    status = httpx.get(f"{crowded.url}/v1/status").json()
    document = httpx.get(f"{crowded.url}/openapi.json").json()
    schema = document["paths"]["/v1/status"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    jsonschema.validate(status, {**schema, "components": document["components"]})
    assert status["crowded"] == [{k: said[k] for k in ("host", "hostname", "ranks", "cores", "advice")}], status
    page = browser.open(crowded)
    page.click("#tab-cluster")
    page.wait_for_selector('.rank[data-rank="1"]')
    assert page.locator("#crowded .warning").text_content() == said["advice"]
    shoot(page, shots, "crowded")


@pytest.fixture(scope="module")
def router(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two tiny models behind a router (docs/several-models.md)."""
    models = ("--model", str(tiny_models["qwen3"]), "--model", str(tiny_models["llama"]))
    with serving(tmp_path_factory, *models, "--speculate", "off") as started:
        yield started


def test_a_router_of_several_models_lets_the_page_pick_one_and_chat_with_it(
    browser: Browser, router: Server, shots: Path
) -> None:
    body = {"model": "qwen3", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).status_code == 200
    page = browser.open(router)  # it shows the loaded model first
    assert page.locator("#model-picker").is_visible()
    assert page.locator("#model-picker option").all_text_contents() == ["qwen3 (loaded)", "llama (unloaded)"]
    assert page.locator("#model-name").text_content() == "qwen3"
    page.select_option("#model-picker", "llama")
    page.wait_for_selector("#model-name:text('llama')")
    assert "unloaded" in (page.locator("#readiness").text_content() or "")
    reply = send(page, "Hello", 4)
    page.wait_for_selector(".message.assistant[data-done=done]")
    assert reply.locator(".error").count() == 0, reply.text_content()
    assert router.find_log("request started", model="llama") is not None  # the chat went to the picked model
    page.wait_for_selector("#readiness.ready")
    shoot(page, shots, "router")
