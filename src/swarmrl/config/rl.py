"""Config of the learning algorithm: GRPO-family RL, the SFT warm start, and evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from swarmrl.config.base import Section


class SamplingConfig(Section):
    """Sampling parameters of rollout generation (seeded Gumbel-max; see swarmrl.inference)."""

    temperature: float = Field(1.0, gt=0, description="softmax temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass kept")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = all")
    max_new_tokens: int = Field(6, gt=0, description="decode at most this many tokens")


class RLConfig(Section):
    """GRPO with two-sided clipping (DESIGN.md §4)."""

    steps: int = Field(20, ge=0, description="optimizer steps")
    prompts_per_step: int = Field(32, gt=0, description="groups per batch")
    group_size: int = Field(8, ge=2, description="completions per prompt (G)")
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    eps_low: float = Field(0.2, ge=0, lt=1, description="lower clip: ratio ≥ 1 − eps_low")
    eps_high: float = Field(0.2, ge=0, description="upper clip: ratio ≤ 1 + eps_high")
    delta: float = Field(4.0, gt=1, description="hard cap on the ratio (bounds negative-A loss)")
    max_log_ratio: float = Field(10.0, gt=0, description="log-ratio clamp before exp")
    advantage: Literal["std", "mean"] = Field(
        "std", description="std: (r−mean)/(std+1e-6); mean: r−mean (Dr.GRPO)"
    )
    kl_coef: float = Field(0.0, ge=0, description="k3 KL penalty to the reference policy")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
    online_filter: bool = Field(True, description="drop zero-variance groups and backfill")
    max_backfill_rounds: int = Field(3, ge=0, description="extra sampling rounds to fill a batch")
    logprob_chunk: int = Field(1024, gt=0, description="positions per chunk in log-prob passes")
    micro_batch: int = Field(256, gt=0, description="sequences per forward/backward pass")
    async_level: int = Field(2, ge=0, description="step n trains on versions ≥ n − async_level")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)


class SFTConfig(Section):
    """Warm start by supervised fine-tuning on generated worked examples."""

    steps: int = Field(350, ge=0, description="optimizer steps")
    batch_size: int = Field(128, gt=0, description="examples per step")
    lr: float = Field(2e-3, gt=0, description="AdamW learning rate")
    train_examples: int = Field(20000, gt=0, description="size of the fixed SFT set")
    label_noise: float = Field(
        0.6,
        ge=0,
        le=1,
        description="share of SFT answers showing the task's characteristic mistake; above 0.5 "
        "the mistake is the most likely answer, so imitation plateaus",
    )


class EvalConfig(Section):
    """Held-out evaluation."""

    n: int = Field(500, gt=0, description="held-out problems")
    samples: int = Field(1, ge=1, description="sampled completions per problem for pass@1")
    every: int = Field(
        10,
        ge=0,
        description="RL steps between held-out evaluations during training (0 = before/after only)",
    )
    control: bool = Field(
        True, description="also continue the warm start's SFT for the RL wall time and evaluate"
    )
