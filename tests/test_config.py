import json

import pytest

from swarmrl.config import EMBEDDED_DEFAULT, load_config, parse_override, save_config
from swarmrl.errors import ConfigError, MissingPathError


def test_override_parses_toml_literals():
    assert parse_override("rl.group_size=8") == {"rl": {"group_size": 8}}
    assert parse_override("rl.lr=0.5") == {"rl": {"lr": 0.5}}
    assert parse_override("env.name=reverse") == {"env": {"name": "reverse"}}
    assert parse_override("env.length_budget.targets=[4, 8]") == {
        "env": {"length_budget": {"targets": [4, 8]}}
    }


def test_layers_apply_in_order(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text("[rl]\ngroup_size = 4\nlr = 0.01\n")
    config = load_config([toml], ["rl.group_size=6"])
    assert config.rl.group_size == 6  # override beats file
    assert config.rl.lr == 0.01  # file beats default
    assert config.rl.eps_low == 0.2  # default survives


def test_embedded_default_loads():
    config = load_config([EMBEDDED_DEFAULT])
    assert config.env.name == "arith"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("rl.bogus=1", "unknown config key 'rl.bogus'"),
        ("rl.group_size=x", "'rl.group_size'"),
        ("rl.advantage=foo", "'std' or 'mean'"),
        ("rl.group_size=1", "greater than or equal to 2"),
        ("novalue", "section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config([], [override])
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(MissingPathError):
        load_config([tmp_path / "nope.toml"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[rl\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config([bad])


def test_resolved_config_is_saved(tmp_path):
    config = load_config([], ["rl.steps=3"])
    path = save_config(config, tmp_path)
    assert json.loads(path.read_text())["rl"]["steps"] == 3


def test_cache_dir_is_the_user_cache_wherever_a_run_starts(tmp_path, monkeypatch):
    """A run started from another directory finds the same warm-start cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    caches = set()
    for cwd in (tmp_path / "a", tmp_path / "b"):
        cwd.mkdir()
        monkeypatch.chdir(cwd)
        caches.add(load_config([EMBEDDED_DEFAULT], []).run.cache_dir)
    assert caches == {str(tmp_path / "xdg" / "swarmrl")}
