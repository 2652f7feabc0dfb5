"""Experiment trackers: every step row and held-out evaluation, also sent to W&B or TensorBoard.

``[log] wandb = true`` and ``[log] tensorboard = true`` (``swarmrl.config.log``) choose them.
A row is the training loop's row (``swarmrl.trainer.loop.ROW_KEYS``, what ``metrics.jsonl``
holds); its numeric values go under ``train/<key>`` at x = the row's ``step``, held-out
accuracies under ``eval/<name>_accuracy``. ``None`` values (no loss on an empty step) are left
out. W&B runs offline with ``WANDB_MODE=offline`` (files under ``RUN_DIR/wandb``); TensorBoard
writes event files into ``RUN_DIR/tensorboard``. A tracker that is asked for but not installed
is a one-line :class:`~swarmrl.errors.UserError` naming the install command, raised before
training starts.

Knows nothing about how rows are computed; :func:`tracked` adds trackers to a loop's hooks.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from swarmrl.errors import UserError
from swarmrl.trainer.loop import Hooks

if TYPE_CHECKING:
    from swarmrl.config import SwarmConfig


class Tracker(Protocol):
    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _require(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UserError(f"[log] {extra} = true needs {module}: pip install 'swarmrl[{extra}]'")


class WandbTracker:
    """One W&B run; ``mode`` follows ``WANDB_MODE`` (``offline`` needs no account)."""

    def __init__(self, config: SwarmConfig, run_dir: Path) -> None:
        import wandb

        self.run = wandb.init(
            project=config.log.wandb_project,
            entity=config.log.wandb_entity,
            name=run_dir.name,
            dir=str(run_dir),
            config=config.model_dump(mode="json"),
        )

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorboardTracker:
    """Event files in ``RUN_DIR/tensorboard`` (torch's writer)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Trackers:
    """The trackers a config asks for, fed rows and evaluations."""

    def __init__(self, config: SwarmConfig, run_dir: Path) -> None:
        if config.log.wandb:
            _require("wandb", "wandb")
        if config.log.tensorboard:
            _require("tensorboard", "tensorboard")
        self.trackers: list[Tracker] = []
        self.step = 0
        if config.log.wandb:
            self.trackers.append(WandbTracker(config, run_dir))
        if config.log.tensorboard:
            self.trackers.append(TensorboardTracker(run_dir))

    def log_row(self, row: dict[str, Any]) -> None:
        self.step = int(row["step"])
        values = {
            f"train/{k}": float(v)
            for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"
        }
        for tracker in self.trackers:
            tracker.scalars(values, self.step)

    def log_eval(self, name: str, result: dict[str, Any]) -> None:
        if isinstance(result.get("accuracy"), int | float):
            for tracker in self.trackers:
                tracker.scalars({f"eval/{name}_accuracy": float(result["accuracy"])}, self.step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tracked(hooks: Hooks, trackers: Trackers) -> Hooks:
    """``hooks`` that also feed ``trackers``."""
    if not trackers.trackers:
        return hooks

    def on_step(row: dict[str, Any]) -> None:
        hooks.on_step(row)
        trackers.log_row(row)

    def on_eval(name: str, result: dict[str, Any]) -> None:
        hooks.on_eval(name, result)
        trackers.log_eval(name, result)

    return replace(hooks, on_step=on_step, on_eval=on_eval)
