"""Experiment trackers, offline: the rows metrics.jsonl gets also reach W&B and TensorBoard."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from swarmrl.config import SwarmConfig
from swarmrl.errors import UserError
from swarmrl.trainer.loop import Hooks
from swarmrl.trainer.trackers import Trackers, tracked

ROWS = [
    {"step": 0, "policy_version": 0, "reward_mean": 0.25, "accuracy": 0.5, "loss": None},
    {"step": 1, "policy_version": 1, "reward_mean": 0.75, "accuracy": 0.5, "loss": 0.125},
]


def _feed(config: SwarmConfig, run_dir: Path) -> list[dict]:
    seen: list[dict] = []
    with Trackers(config, run_dir) as trackers:
        hooks = tracked(Hooks(on_step=seen.append), trackers)
        for row in ROWS:
            hooks.on_step(row)
        hooks.on_eval("after", {"accuracy": 0.875, "n": 8})
    return seen


def test_tensorboard_gets_every_numeric_value_of_every_row(tmp_path: Path):
    pytest.importorskip("tensorboard", reason="pip install 'swarmrl[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = SwarmConfig.model_validate({"log": {"tensorboard": True}})
    assert _feed(config, tmp_path) == ROWS  # the caller's own hooks still see each row
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert series("train/reward_mean") == [(0, 0.25), (1, 0.75)]
    assert series("train/loss") == [(1, 0.125)]  # None is left out, not logged as 0
    assert series("eval/after_accuracy") == [(1, 0.875)]
    assert "train/step" not in events.Tags()["scalars"]


def test_wandb_offline_run_records_the_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("wandb", reason="pip install 'swarmrl[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = SwarmConfig.model_validate({"log": {"wandb": True, "wandb_project": "test"}})
    with Trackers(config, tmp_path) as trackers:
        hooks = tracked(Hooks(), trackers)
        for row in ROWS:
            hooks.on_step(row)
        hooks.on_eval("after", {"accuracy": 0.875, "n": 8})
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1  # the offline run file `wandb sync` uploads later
    deadline = time.monotonic() + 30  # W&B's service process may still be flushing the file
    while b"eval/after_accuracy" not in runs[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    data = runs[0].read_bytes()
    # history records hold each key and its value as JSON text
    for text in (b"train/reward_mean", b"0.75", b"train/loss", b"0.125", b"eval/after_accuracy"):
        assert text in data, text


def test_a_tracker_that_is_not_installed_is_a_one_line_error(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    config = SwarmConfig.model_validate({"log": {"wandb": True}})
    with pytest.raises(UserError, match=r"pip install 'swarmrl\[wandb\]'") as err:
        Trackers(config, tmp_path)
    assert "\n" not in str(err.value)


def test_no_tracker_leaves_the_hooks_as_they_are(tmp_path: Path):
    hooks = Hooks()
    with Trackers(SwarmConfig(), tmp_path) as trackers:
        assert tracked(hooks, trackers) is hooks
    assert list(tmp_path.iterdir()) == []
