"""Config of how the trainer executes: ranks, sharding options and checkpoints.

What the trainer computes is ``[rl]``; this section only says how it is laid out on processes
and how it survives a restart.
"""

from __future__ import annotations

from pydantic import Field

from swarmrl.config.base import Section, path_key


class TrainerConfig(Section):
    """Execution of the trainer (``swarmrl trainer`` and the colocated loop)."""

    nproc: int = Field(
        1,
        ge=1,
        description="trainer processes (ranks) on this node; >1 starts the trainer under "
        "torchrun with FSDP2 (gloo on CPU, NCCL on GPU)",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in the backward pass"
    )
    checkpoint_every: int = Field(
        0,
        ge=0,
        description="save a checkpoint every this many optimizer steps (0: only at a clean stop)",
    )
    checkpoint_dir: str | None = Field(
        None,
        description="where checkpoints go (None: RUN_DIR/trainer/checkpoints for the swarm "
        "trainer; no checkpoints in a colocated run)",
        json_schema_extra=path_key(),
    )
    rank_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="longest wait of one rank for the others at a collective (s) before it "
        "fails instead of hanging",
    )
