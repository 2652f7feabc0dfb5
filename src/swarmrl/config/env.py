"""Config of the verifiable environment (task) the policy is trained on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from swarmrl.config.base import Section


class LengthBudgetConfig(Section):
    """Thinking-budget wrapper: r = r_task − alpha·|target − length| (mode-dependent)."""

    enabled: bool = Field(False, description="wrap the task with a per-prompt target length")
    targets: list[int] = Field(
        default_factory=lambda: [8, 16], description="target lengths, tokens"
    )
    alpha: float = Field(3e-4, ge=0, description="penalty per token of deviation")
    mode: Literal["exact", "max", "clip"] = Field(
        "exact",
        description="exact: r−α|t−l|; max: only overshoot costs; clip: r·(1−α|t−l|), never < 0",
    )


class EnvConfig(Section):
    """Which task, and how its problems are drawn."""

    name: Literal["arith", "reverse", "math"] = Field("arith", description="built-in task")
    digits: int = Field(3, ge=1, le=9, description="arith: digits per operand")
    reverse_len: int = Field(6, ge=1, description="reverse: characters per string")
    dataset: str | None = Field(None, description="math: local JSONL or Parquet file")
    heldout_fraction: float = Field(
        0.1, gt=0, lt=1, description="share of the problem space reserved for held-out eval"
    )
    length_budget: LengthBudgetConfig = Field(default_factory=LengthBudgetConfig)
