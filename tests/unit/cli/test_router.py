"""``neuron serve`` with several models (``cli.router``): when it routes, what each model's server is told on its
command line and in its environment, and what is refused before anything starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from neuron.cli import router
from neuron.cli.main import _parser
from neuron.config import sources


@pytest.fixture(autouse=True)
def _no_settings_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEURON_LOG_LEVEL", raising=False)  # the tests' own (tests/conftest.py)


def _args(tmp_path: Path, *argv: str, toml: str = "") -> argparse.Namespace:
    config = tmp_path / "neuron.toml"
    config.write_text(toml)
    args = _parser().parse_args(["serve", "--config", str(config), *argv])
    assert sources.resolve(args, "serve") == []
    return args


def test_one_model_does_not_route_and_two_do(tmp_path: Path) -> None:
    assert not router.several(_args(tmp_path, "--model", "/m/a"))
    assert not router.several(_args(tmp_path))
    assert router.several(_args(tmp_path, "--model", "/m/a", "--model", "/m/b"))
    assert router.several(_args(tmp_path, toml='[[models]]\nmodel = "/m/a"\n'))


def test_each_server_gets_the_settings_given_here_and_its_own_table_over_them(tmp_path: Path) -> None:
    toml = 'max_batch = 4\ntp = 2\n[[models]]\nmodel = "/m/a"\n[[models]]\nmodel = "/m/b"\ntp = 1\npp = 2\n'
    args = _args(tmp_path, "--speculate", "off", "--models-max", "1", "--api-key", "secret", toml=toml)
    (a, b), problems = router.declare(args)
    assert problems == []
    served = ["--max-batch", "4", "--speculate", "off"]
    assert router.server_flags(args, a, 1) == ["--tp", "2", "--served-model-name", "a", *served]
    assert router.server_flags(args, b, 1) == ["--tp", "1", "--pp", "2", "--served-model-name", "b", *served]


def test_each_server_budgets_its_part_of_the_memory_as_many_as_may_be_loaded_at_once(tmp_path: Path) -> None:
    models = ("--model", "/m/a", "--model", "/m/b", "--model", "/m/c")
    args = _args(tmp_path, *models)
    declared, _ = router.declare(args)
    assert router.at_once(args, declared) == 3
    assert router.server_flags(args, declared[0], 3) == ["--served-model-name", "a", "--memory-share", "0.3333"]
    capped = _args(tmp_path, *models, "--models-max", "2", "--memory-share", "0.8")
    assert router.at_once(capped, declared) == 2
    assert router.server_flags(capped, declared[0], 2) == ["--served-model-name", "a", "--memory-share", "0.4"]


def test_a_server_reads_no_setting_from_the_environment_and_gets_the_keys_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEURON_TP", "2")
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("HOME_OF_THE_TEST", "kept")
    env = router.server_env(_args(tmp_path, "--model", "/m/a", "--model", "/m/b", "--api-key", "secret"))
    assert "NEURON_TP" not in env and "NOTIFY_SOCKET" not in env
    assert env["HOME_OF_THE_TEST"] == "kept" and env["NEURON_API_KEY"] == "secret"


def test_models_both_as_flags_and_as_tables_are_refused(tmp_path: Path) -> None:
    args = _args(tmp_path, "--model", "/m/a", toml='[[models]]\nmodel = "/m/b"\n')
    assert router.problems(args)[0].startswith("give the models either as --model")


def test_the_same_name_twice_is_refused_at_start(tmp_path: Path) -> None:
    args = _args(tmp_path, "--model", "/a/qwen3", "--model", "/b/qwen3")
    assert any("declared more than once" in p for p in router.problems(args))


def test_preload_loads_every_table_at_start(tmp_path: Path) -> None:
    args = _args(tmp_path, "--preload", toml='[[models]]\nmodel = "/m/a"\n[[models]]\nmodel = "/m/b"\n')
    assert [m.preload for m in router.declare(args)[0]] == [True, True]


def _total() -> int:
    from neuron.launch import cgroup
    from neuron.launch.hosts import total_memory

    group = cgroup.own_group()
    return total_memory(cgroup.room(group) if group else None)


def _sparse_model(folder: Path, size: int) -> Path:
    """A model folder whose weights' file is ``size`` bytes long and holds nothing (a sparse file)."""
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as weights:
        weights.truncate(size)
    return folder


def test_a_model_larger_than_the_host_is_refused_at_start(tmp_path: Path) -> None:
    big = _sparse_model(tmp_path / "big", _total())
    small = _sparse_model(tmp_path / "small", 1 << 20)
    problems = router.problems(_args(tmp_path, "--model", str(big), "--model", str(small)))
    assert len(problems) == 1 and problems[0].startswith("the model 'big' needs about"), problems


def test_models_preloaded_together_beyond_the_hosts_memory_are_refused_at_start_naming_them(tmp_path: Path) -> None:
    half = int(_total() * 0.45)
    models = [str(_sparse_model(tmp_path / name, half)) for name in ("a", "b")]
    toml = f"[[models]]\nmodel = '{models[0]}'\npreload = true\n[[models]]\nmodel = '{models[1]}'\npreload = true\n"
    problems = router.problems(_args(tmp_path, toml=toml))
    assert len(problems) == 1 and problems[0].startswith("the models 'a', 'b' are preloaded together"), problems
    on_demand = toml.replace("preload = true\n", "", 1)
    assert router.problems(_args(tmp_path, toml=on_demand)) == []  # one loads on demand: the other makes room


def test_models_sharing_a_host_beyond_its_memory_are_refused_unless_fewer_may_be_loaded_at_once(
    tmp_path: Path,
) -> None:
    tables = ""
    for name in ("a", "b"):
        folder = _sparse_model(tmp_path / name, 600 << 20)
        hostfile = tmp_path / f"{name}.json"
        hostfile.write_text('[{"ssh": "localhost"}, {"ssh": "far"}]')
        tables += f"[[models]]\nmodel = '{folder}'\nhosts = '{hostfile}'\n"
    gib = 1 << 30
    args = _args(tmp_path, toml=tables)
    declared, _ = router.declare(args)
    found = router.shared_hosts(args, declared, lambda host: gib if host.ssh == "far" else 64 * gib)
    assert len(found) == 1 and found[0].startswith("the models 'a', 'b' have ranks on the host far"), found
    assert router.shared_hosts(args, declared, lambda host: 64 * gib) == []  # room for both
    assert router.shared_hosts(args, declared, lambda host: None) == []  # unread: its server says, as it starts
    capped = _args(tmp_path, "--models-max", "1", toml=tables)
    assert router.shared_hosts(capped, router.declare(capped)[0], lambda host: gib) == []
