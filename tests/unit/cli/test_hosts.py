"""``neuron hosts`` finds the leader as ``serve`` reads its settings (flags aside), or from ``--url``, and shows what
the leader says. No server: the calls themselves are tests/e2e/hosts/test_hosts_command.py's."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from neuron.cli.hosts import LeaderError, entry, leader, render


@pytest.fixture(autouse=True)
def no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NEURON_HOST", "NEURON_PORT", "NEURON_API_KEY", "NEURON_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def test_the_leader_is_where_serves_settings_put_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert leader(None, None) == ("http://127.0.0.1:8000", None)
    config = tmp_path / "neuron.toml"
    config.write_text('host = "0.0.0.0"\nport = 8123\napi_key = "from-file"\n')
    assert leader(None, str(config)) == ("http://127.0.0.1:8123", "from-file")  # every address answers on loopback
    monkeypatch.setenv("NEURON_HOST", "::")
    monkeypatch.setenv("NEURON_API_KEY", "from-env")
    assert leader(None, str(config)) == ("http://[::1]:8123", "from-env")  # the environment before the file
    assert leader("http://10.0.0.1:9000/", str(config)) == ("http://10.0.0.1:9000", "from-env")


def test_a_leader_that_cannot_be_found_is_refused_saying_what_to_give(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_PORT", "0")
    with pytest.raises(LeaderError, match="give the leader's --url"):
        leader(None, None)
    monkeypatch.setenv("NEURON_PORT", "eighty")
    with pytest.raises(LeaderError, match="NEURON_PORT"):
        leader(None, None)


def test_add_sends_a_hostfile_entry() -> None:
    args = argparse.Namespace(host="me@mac3", ips=["10.0.0.3"], model=None, neuron="/opt/n", cpus="0, 1")
    assert entry(args) == {"ssh": "me@mac3", "ips": ["10.0.0.3"], "neuron": "/opt/n", "cpus": [0, 1]}
    with pytest.raises(LeaderError, match="--cpus must list core numbers"):
        entry(argparse.Namespace(**{**vars(args), "cpus": "a"}))


def test_the_listing_shows_each_rank_then_the_spares_then_the_file() -> None:
    shown = render(
        {
            "ranks": [
                {"rank": 0, "host": "localhost", "state": "ok", "reason": None},
                {"rank": 1, "host": "me@mac2", "state": "lost", "reason": "ssh exited"},
            ],
            "spares": [{"host": "me@mac3", "state": "standing by"}],
            "hostfile": "/etc/neuron/hosts.json",
        }
    )
    assert shown.splitlines() == [
        "rank   host       state",
        "0      localhost  ok",
        "1      me@mac2    lost (ssh exited)",
        "spare  me@mac3    standing by",
        "hostfile: /etc/neuron/hosts.json",
    ]
