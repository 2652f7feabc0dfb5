import json
import os
import shutil
from pathlib import Path

import pytest

from swarmrl.config import EMBEDDED_DEFAULT, load_config, parse_override, save_config
from swarmrl.config.load import read_toml
from swarmrl.envs import build_env
from swarmrl.errors import ConfigError, MissingPathError
from swarmrl.launch.plan import write_config_toml


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


REPO = Path(__file__).resolve().parents[1]


def test_paths_in_a_config_file_are_taken_from_its_folder(tmp_path, monkeypatch):
    """A config and its data travel together: run from elsewhere, the file's relative paths
    still name the files beside it, while a ``--set`` path is taken from where it was typed."""
    folder = tmp_path / "project" / "configs"
    (folder / "data").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "data" / "math-small.jsonl", folder / "data" / "d.jsonl")
    (folder / "my.toml").write_text(
        '[env]\nname = "math"\ndataset = "data/d.jsonl"\nanswer_format = "plain"\n'
        '[toploc]\nthresholds_path = "t.json"\n[run]\nrun_dir = "../runs"\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(["../project/configs/my.toml"], ["trainer.checkpoint_dir=ck"])
    assert config.env.dataset == str(folder / "data" / "d.jsonl")
    assert config.toploc.thresholds_path == str(folder / "t.json")
    assert config.run.run_dir == str(tmp_path / "project" / "runs")
    assert config.trainer.checkpoint_dir == str(elsewhere / "ck")  # --set: the current dir
    assert build_env(config.env).split_size("train") == 360  # the file's 400 rows were read


def test_hub_ids_and_commands_are_not_taken_for_paths(tmp_path, monkeypatch):
    toml = tmp_path / "hub.toml"
    toml.write_text(
        '[env]\nname = "math"\ndataset = "openai/gsm8k"\n[env.sandbox]\npython = "python3"\n'
        '[model]\npath = "Qwen/Qwen2.5-0.5B"\n[pool]\nstore_url = "s3://bucket/rollouts"\n'
    )
    monkeypatch.chdir(tmp_path)
    config = load_config([toml], ["env.sandbox.python=bin/python"])
    assert config.env.dataset == "openai/gsm8k"
    assert config.model.path == "Qwen/Qwen2.5-0.5B"
    assert config.pool.store_url == "s3://bucket/rollouts"
    assert config.env.sandbox.python == str(tmp_path / "bin" / "python")


def test_the_shipped_math_config_reads_its_data_from_another_directory(tmp_path, monkeypatch):
    """``swarmrl run ../swarmrl/configs/math.toml`` from a sibling directory finds its data."""
    monkeypatch.chdir(tmp_path)
    config = load_config([os.path.relpath(REPO / "configs" / "math.toml")])
    assert Path(config.env.dataset).is_file()
    assert build_env(config.env).split_size("heldout") == 40


def test_a_resolved_config_written_elsewhere_reads_back_the_same(tmp_path, monkeypatch):
    """``swarmrl run`` writes the resolved config into the run directory and starts every role
    with that file: its paths must mean there what they meant at first."""
    monkeypatch.chdir(tmp_path)
    config = load_config([REPO / "configs" / "math.toml"], ["env.train_subset=keep.jsonl"])
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    written = write_config_toml(config, run_dir / "config.toml")
    assert load_config([written]) == config


# the keys of the tested demo config that a user's short config leaves out
THREE_LINES = '[env]\nname = "arith"\n[rl]\nsteps = 20\n'


def _leaves(table: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_a_three_line_config_gets_the_tested_values(tmp_path):
    """Defaults are the values the demo config was tested with (initializer_range 0.1, not the
    0.02 that stalls; 350 warm-start steps; …), so a short config is a working one."""
    short = tmp_path / "short.toml"
    short.write_text(THREE_LINES)
    config = load_config([short]).model_dump(mode="json")
    tested = load_config([EMBEDDED_DEFAULT]).model_dump(mode="json")
    differing = {
        key: (_leaves(config)[key], value)
        for key, value in _leaves(read_toml(EMBEDDED_DEFAULT)).items()
        if _leaves(config)[key] != value
    }
    assert differing == {}, f"defaults differ from configs/arith.toml: {differing}"
    assert config == tested


def test_below_float32_the_toploc_defaults_follow_the_dtype(tmp_path):
    """A pool generating in bfloat16 or float16 needs other toploc settings than float32's
    (docs/toploc.md, "int8 below float32"): they are the defaults there, and whatever a file or
    an override sets wins, also when it is float32's value, and reads back the same. The run's
    own calibration and a thresholds file give the same settings (a role reading the file and
    one calibrating must agree); without a calibration the evidence stays in threshold units."""
    from swarmrl.config.toploc import (
        LOWER_DTYPE_SETTINGS,
        UNCALIBRATED_LOWER_DTYPE_SETTINGS,
        ToplocConfig,
    )

    def settings(toploc: ToplocConfig, keys) -> dict:
        return {k: getattr(toploc, k) for k in keys}

    float32 = ToplocConfig()
    plain = load_config([], [])
    assert plain.engine_dtype == "float32" and plain.toploc == float32
    follows = load_config([], ["model.dtype=bfloat16", "inference.dtype=float32"]).toploc
    assert follows == float32  # the workers' dtype decides, not the trainer's
    for dtype in ("inference.dtype=bfloat16", "model.dtype=float16"):
        toploc = load_config([], [dtype]).toploc
        assert settings(toploc, LOWER_DTYPE_SETTINGS) == LOWER_DTYPE_SETTINGS
        assert toploc.evidence_drift == float32.evidence_drift  # the rest as in float32
    toml = tmp_path / "bf16.toml"
    toml.write_text('[inference]\ndtype = "bfloat16"\n[toploc]\ncalibration_samples = 64\n')
    config = load_config([toml], ["toploc.evidence_scale=0"])
    assert config.toploc.calibration_samples == 64  # float32's value, set by the file
    assert config.toploc.evidence_scale == 0.0  # by the override
    assert config.toploc.evidence_limit == LOWER_DTYPE_SETTINGS["evidence_limit"]
    written = write_config_toml(config, tmp_path / "config.toml")
    assert load_config([written]) == config
    # a validator given the thresholds file the trainer wrote judges on the trainer's terms
    given = tmp_path / "thresholds.json"
    filed = load_config([], ["inference.dtype=bfloat16", f"toploc.thresholds_path={given}"])
    assert (
        filed.toploc.model_copy(update={"thresholds_path": None})
        == load_config([], ["inference.dtype=bfloat16"]).toploc
    )
    # no calibration records the honest means the scale would measure in: threshold units
    blind = load_config([], ["inference.dtype=bfloat16", "toploc.calibrate_at_start=false"])
    assert settings(blind.toploc, UNCALIBRATED_LOWER_DTYPE_SETTINGS) == (
        UNCALIBRATED_LOWER_DTYPE_SETTINGS
    )
    assert blind.toploc.evidence_scale == 0.0 and blind.toploc.evidence_measure_limits == {}


def test_the_engines_a_pool_accepts_include_the_runs_own():
    """``toploc.engines`` names the engines the pool accepts and the run-start calibration
    measures; unset, the run's own backend alone. A list without the run's own backend, or
    naming an engine twice or one not known, is a one-line error at load."""
    assert load_config([], []).pool_engines == ["torch"]
    assert load_config([], ["inference.backend=vllm"]).pool_engines == ["vllm"]
    both = load_config([], ["inference.backend=vllm", 'toploc.engines=["torch","vllm"]'])
    assert both.pool_engines == ["torch", "vllm"]
    for bad, words in (
        ('toploc.engines=["vllm"]', "inference.backend 'torch' is not among toploc.engines"),
        ('toploc.engines=["torch","torch"]', "name each engine once"),
        ('toploc.engines=["sglang"]', "'toploc.engines.0'"),
    ):
        with pytest.raises(ConfigError) as refused:
            load_config([], [bad])
        message = str(refused.value)
        assert "\n" not in message and words in message, message
