"""The API keys a server takes (``server.keys``): named from ``--api-key`` and the keys file, found by what a request
gives, and every mistake in the file named with what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron.server.keys import Key, KeysError, load


def _file(tmp_path: Path, data: object) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_no_key_given_asks_none() -> None:
    assert load(None, None) is None


def test_each_api_key_is_named_by_its_place_and_may_call_admin_routes() -> None:
    keys = load("first, second", None)  # a repeated flag's values, joined
    assert keys is not None and keys.names == ("key-1", "key-2")
    assert keys.find(b"second") == Key("key-2", admin=True)
    assert keys.find(b"secon") is None and keys.find(b"") is None


def test_the_keys_file_names_each_key_its_admin_right_and_best_priority(tmp_path: Path) -> None:
    entries = [{"name": "ops", "key": "o", "admin": True}, {"name": "agents", "key": "a", "best_priority": 10}]
    keys = load("flag", _file(tmp_path, {"keys": entries}))
    assert keys is not None and keys.names == ("key-1", "ops", "agents")
    assert keys.find(b"o") == Key("ops", admin=True)
    assert keys.find(b"a") == Key("agents", admin=False, best_priority=10)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ("{not json", "not JSON"),
        ({"keys": []}, 'whose "keys" lists the keys'),
        ([{"name": "a", "key": "k"}], 'whose "keys" lists the keys'),
        ({"keys": [{"name": "a", "key": "k", "admn": True}]}, "unknown field(s) admn"),
        ({"keys": [{"name": "a b", "key": "k"}]}, '"name" must be 1 to 64 letters'),
        ({"keys": [{"name": "a"}]}, '"key" must be a string'),
        ({"keys": [{"name": "a", "key": " k"}]}, "no spaces around it"),
        ({"keys": [{"name": "a", "key": "k", "admin": "yes"}]}, '"admin" must be true or false'),
        ({"keys": [{"name": "a", "key": "k", "best_priority": 1.5}]}, '"best_priority" must be an integer'),
        ({"keys": [{"name": "a", "key": "k"}, {"name": "b", "key": "k"}]}, "the key is also 'a''s"),
        ({"keys": [{"name": "a", "key": "k"}, {"name": "a", "key": "j"}]}, "the name 'a' is taken"),
    ],
)
def test_a_mistake_in_the_keys_file_is_named_with_what_to_change(tmp_path: Path, data: object, words: str) -> None:
    with pytest.raises(KeysError, match="--api-keys-file") as refused:
        load(None, _file(tmp_path, data))
    assert words in str(refused.value)


def test_a_missing_keys_file_and_a_flag_key_in_the_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(KeysError, match="cannot be read"):
        load(None, str(tmp_path / "absent.json"))
    with pytest.raises(KeysError, match="the key is also 'key-1''s"):
        load("k", _file(tmp_path, {"keys": [{"name": "a", "key": "k"}]}))
