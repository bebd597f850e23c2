"""The page at ``/`` and the status route it reads, without a model: the files are served with a
Content-Security-Policy that forbids inline scripts and styles, hold none themselves, and carry no key; the status
route's body matches the OpenAPI document; the page can be turned off; the page's files, like the status, sit
behind the key, which a browser gives as HTTP Basic's password. The page in a real browser, on a served model, is
tests/e2e/serving/test_page_browser.py."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import jsonschema
import pytest
from starlette.testclient import TestClient

from neuron.cli.main import _parser
from neuron.config import sources
from neuron.engine.loop import Recent
from neuron.server.app import ServerState, build_app
from neuron.server.keys import load
from neuron.server.page.routes import FILES
from neuron.server.status import rank_state

KEY = "sk-page-test-secret"
BEARER = {"authorization": f"Bearer {KEY}"}
PAGE = ("/", "/page/page.js", "/page/page.css")


def basic(user: str, password: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture
def client() -> Iterator[TestClient]:
    state = ServerState("tiny", keys=load(KEY, None))
    with TestClient(build_app(state), raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
        yield client


def csp(header: str) -> dict[str, list[str]]:
    return {part.split()[0]: part.split()[1:] for part in header.split(";") if part.strip()}


@pytest.mark.parametrize("path", ["/", "/page/page.js", "/page/page.css"])
def test_every_file_of_the_page_forbids_inline_scripts_and_styles(client: TestClient, path: str) -> None:
    response = client.get(path, headers=BEARER)
    assert response.status_code == 200, response.text
    policy = csp(response.headers["content-security-policy"])
    assert policy["script-src"] == ["'self'"] and policy["style-src"] == ["'self'"], policy
    assert policy["default-src"] == ["'none'"] and policy["connect-src"] == ["'self'"]
    assert policy["frame-ancestors"] == ["'none'"]
    assert response.headers["x-content-type-options"] == "nosniff"


class Inline(HTMLParser):
    """What in a document the policy would block: inline scripts, event-handler attributes, style attributes
    and elements, and anything loaded from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = dict(attrs)
        if tag == "script" and not names.get("src"):
            self.found.append("an inline <script>")
        if tag == "style":
            self.found.append("a <style> element")
        for name, value in attrs:
            if name.startswith("on") or name == "style":
                self.found.append(f"<{tag} {name}=...>")
            if name in ("src", "href") and value and re.match(r"^(https?:)?//", value):
                self.found.append(f"<{tag} {name}={value}> loads from another host")


def test_the_page_holds_no_inline_script_style_or_handler_and_loads_nothing_from_elsewhere() -> None:
    parser = Inline()
    parser.feed(FILES["index.html"].decode())
    assert not parser.found, parser.found
    script = FILES["page.js"].decode()
    assert "innerHTML" not in script and "eval(" not in script, "model text must never be read as HTML or code"
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", script), "the script calls only this server"


@pytest.mark.parametrize("path", PAGE)
def test_the_page_without_the_key_is_a_basic_challenge_so_the_browser_asks_for_it(
    client: TestClient, path: str
) -> None:
    for refused in ({}, basic("anyone", "sk-wrong"), basic("anyone", ""), {"authorization": "Basic !!not-base64"}):
        response = client.get(path, headers=refused)
        assert response.status_code == 401, (refused, response.text)
        assert response.headers["www-authenticate"] == 'Basic realm="neuron"'
        assert response.json()["error"]["code"] == "invalid_api_key" and KEY not in response.text


@pytest.mark.parametrize("path", PAGE)
def test_the_page_is_served_with_the_key_as_basics_password_or_a_bearer_token_and_holds_none(
    client: TestClient, path: str
) -> None:
    for given in (basic("anyone", KEY), basic("", KEY), basic("neuron", KEY), BEARER):
        response = client.get(path, headers=given)
        assert response.status_code == 200 and KEY not in response.text, (given, response.text)


def test_the_pages_own_calls_pass_with_the_basic_credentials_the_browser_resends(client: TestClient) -> None:
    assert client.get("/v1/status", headers=basic("anyone", KEY)).status_code == 200
    refused = client.get("/v1/status", headers=basic("anyone", "sk-wrong"))
    # An API route's challenge stays Bearer: a script's refused call must not pop up the browser's dialog.
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"


def test_without_a_key_the_page_is_open() -> None:
    with TestClient(build_app(ServerState("tiny")), base_url="http://127.0.0.1") as client:
        for path in PAGE:
            assert client.get(path).status_code == 200


def test_a_file_the_page_lacks_is_a_404_naming_the_page(client: TestClient) -> None:
    response = client.get("/page/secrets.txt", headers=BEARER)
    assert response.status_code == 404 and "open / for the page" in response.json()["error"]["message"]


def test_the_status_needs_the_key_and_matches_its_schema(client: TestClient) -> None:
    assert client.get("/v1/status").status_code == 401
    response = client.get("/v1/status", headers=BEARER)
    assert response.status_code == 200, response.text
    body = response.json()
    schema = client.get("/openapi.json").json()
    status = schema["paths"]["/v1/status"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    jsonschema.validate(body, {**status, "components": schema["components"]})
    assert body["object"] == "status" and body["ready"] is False and body["reason"] == "loading the model"
    assert body["model"] == {"id": "tiny", "vision": False, "architecture": None, "context_length": None}
    assert body["ranks"] == [] and body["events"] == [] and body["queue"] == {"waiting": 0, "running": 0}
    assert set(body["counters"]) >= {"steps", "step_seconds", "completion_tokens", "cancelled"}


def test_the_page_answers_the_same_origin_and_host_checks_as_the_api(client: TestClient) -> None:
    assert client.get("/", headers={"origin": "https://evil.example", **BEARER}).status_code == 403
    assert client.get("/", headers={"host": "rebound.example", **BEARER}).status_code == 403
    assert client.get("/", headers={"origin": "http://127.0.0.1:8000", **BEARER}).status_code == 200


def test_the_page_can_be_turned_off() -> None:
    app = build_app(ServerState("tiny"), with_page=False)
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
        assert client.get("/").status_code == 404
        assert client.get("/page/page.js").status_code == 404
        assert client.get("/v1/status").status_code == 200  # the status route stays: clients may poll it


def test_the_page_is_turned_off_by_a_flag_the_environment_or_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_page(*argv: str) -> bool:
        args = _parser().parse_args(["serve", "--config", str(file), *argv])
        assert sources.resolve(args, "serve") == []
        return bool(args.no_page)

    file = tmp_path / "neuron.toml"
    file.write_text("")
    monkeypatch.delenv("NEURON_NO_PAGE", raising=False)
    assert not no_page()
    assert no_page("--no-page")
    monkeypatch.setenv("NEURON_NO_PAGE", "1")
    assert no_page()
    monkeypatch.delenv("NEURON_NO_PAGE")
    file.write_text("no_page = true\n")
    assert no_page()


def test_a_rank_named_by_the_broken_group_is_lost_and_the_others_wait_for_the_new_group() -> None:
    killed = {1: "worker pid 7 was killed by SIGKILL"}
    assert rank_state(1, killed, loaded=True) == ("lost", killed[1])
    assert rank_state(0, killed, loaded=True) == ("starting", None)
    assert rank_state(1, None, loaded=False) == ("starting", None)  # the new group loads the model
    assert rank_state(1, None, loaded=True) == ("ok", None)


def test_the_recent_steps_are_summed_by_second_and_forgotten_after_the_last_minutes() -> None:
    recent = Recent(kept=60)
    recent.add(0.010, 2, now=1000.2)
    recent.add(0.030, 1, now=1000.9)
    recent.add(0.020, 0, now=1002.5)
    assert recent.seconds(now=1003) == [[1000.0, 2, 0.04, 3], [1002.0, 1, 0.02, 0]]
    assert recent.seconds(now=1060.5) == [[1002.0, 1, 0.02, 0]]  # 1000 is over a minute ago
