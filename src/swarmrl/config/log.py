"""Config of experiment trackers: the same step rows as ``metrics.jsonl``, sent elsewhere too."""

from __future__ import annotations

from pydantic import Field

from swarmrl.config.base import Section


class LogConfig(Section):
    """Experiment trackers the trainer logs every step row and held-out evaluation to."""

    wandb: bool = Field(
        False,
        description="log to Weights & Biases (pip install 'swarmrl[wandb]'; offline with "
        "WANDB_MODE=offline)",
    )
    wandb_project: str = Field("swarmrl", description="W&B project name")
    wandb_entity: str | None = Field(None, description="W&B entity (team); None: your default")
    tensorboard: bool = Field(
        False,
        description="write TensorBoard event files into RUN_DIR/tensorboard "
        "(pip install 'swarmrl[tensorboard]')",
    )
