"""Config of the learning algorithm: GRPO-family RL, the SFT warm start, and evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from swarmrl.config.base import Section


class SamplingConfig(Section):
    """Sampling parameters of rollout generation (seeded Gumbel-max; see swarmrl.inference)."""

    temperature: float = Field(1.0, gt=0, description="softmax temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass kept")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = all")
    max_new_tokens: int = Field(6, gt=0, description="decode at most this many tokens")


class RLConfig(Section):
    """GRPO-family RL: the two-sided clip by default (DESIGN.md §4), or another loss of the
    family (``swarmrl.rl.losses``), with an optional off-policy correction
    (``swarmrl.rl.correction``)."""

    steps: int = Field(20, ge=0, description="optimizer steps")
    prompts_per_step: int = Field(32, gt=0, description="groups per batch")
    group_size: int = Field(8, ge=2, description="completions per prompt (G)")
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    eps_low: float = Field(0.2, ge=0, le=1, description="lower clip: ratio ≥ 1 − eps_low")
    eps_high: float = Field(0.2, ge=0, description="upper clip: ratio ≤ 1 + eps_high")
    delta: float = Field(4.0, gt=1, description="hard cap on the ratio (bounds negative-A loss)")
    max_log_ratio: float = Field(10.0, gt=0, description="log-ratio clamp before exp")
    advantage: Literal["std", "mean"] = Field(
        "std", description="std: (r−mean)/(std+1e-6); mean: r−mean (Dr.GRPO)"
    )
    loss: Literal["clip", "dr_grpo", "dapo", "gspo", "cispo", "tr_mask"] = Field(
        "clip",
        description="policy loss (swarmrl.rl.losses): clip = two-sided clip with δ cap, "
        "token-normalised; dr_grpo = clip with advantage mean (whatever rl.advantage says) "
        "and a constant normaliser (sequences × max_new_tokens); dapo = decoupled clip "
        "without δ, token-normalised (set eps_high above eps_low, e.g. 0.28); gspo = one "
        "length-normalised ratio per sequence, clipped per sequence, mean over sequences (its "
        "paper uses eps 3e-4/4e-4); cispo = REINFORCE with stop-gradient clipped ratio weights "
        "(eps_low, eps_high); tr_mask = −ρ·A with no gradient where ρ leaves [tr_low, tr_high]",
    )
    tr_low: float = Field(0.125, gt=0, description="tr_mask: lowest ratio π_θ/π_b kept")
    tr_high: float = Field(8.0, gt=0, description="tr_mask: highest ratio π_θ/π_b kept")
    correction: Literal["none", "tis_token", "tis_sequence", "mask_token", "mask_sequence"] = Field(
        "none",
        description="off-policy correction (swarmrl.rl.correction) for the mismatch r = "
        "π_old/π_b between the trainer's pre-update log-probs and the behaviour log-probs: "
        "tis_* weights each token by min(r, correction_cap), per token or with the "
        "sequence's product; mask_* drops tokens (or whole sequences) whose r leaves "
        "[correction_low, correction_high]; with any but none the loss's ratio is π_θ/π_old",
    )
    correction_cap: float = Field(2.0, gt=0, description="tis_*: cap on the importance weight")
    correction_low: float = Field(0.5, ge=0, description="mask_*: lowest ratio r kept")
    correction_high: float = Field(2.0, gt=0, description="mask_*: highest ratio r kept")
    correction_decay: float = Field(
        1.0,
        ge=0,
        le=1,
        description="γ: a sample k versions old (its staleness) is corrected with every bound "
        "raised to γ^k (cap, correction_low, correction_high move toward 1 in log space); "
        "1 = age changes nothing, 0 = samples of age ≥ 1 keep no weight above 1",
    )
    kl_coef: float = Field(0.0, ge=0, description="β of the KL penalty to the reference policy")
    kl: Literal["none", "k1", "k3", "squared"] = Field(
        "k3",
        description="KL estimator of the penalty when kl_coef > 0 (swarmrl.rl.kl): k1 = log-ratio,"
        " k3 = exp(d) − d − 1, squared = d²/2; none = no penalty and no reference policy",
    )
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
    online_filter: bool = Field(True, description="drop zero-variance groups and backfill")
    max_backfill_rounds: int = Field(3, ge=0, description="extra sampling rounds to fill a batch")
    logprob_chunk: int = Field(1024, gt=0, description="positions per chunk in log-prob passes")
    micro_batch: int = Field(256, gt=0, description="sequences per forward/backward pass")
    async_level: int = Field(2, ge=0, description="step n trains on versions ≥ n − async_level")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)

    @model_validator(mode="after")
    def _consistent(self) -> RLConfig:
        if self.tr_low >= self.tr_high:
            raise ValueError(f"rl.tr_low ({self.tr_low}) must be below rl.tr_high ({self.tr_high})")
        if self.correction_low >= self.correction_high:
            raise ValueError(
                f"rl.correction_low ({self.correction_low}) must be below rl.correction_high "
                f"({self.correction_high})"
            )
        if self.loss == "tr_mask" and self.correction != "none":
            raise ValueError(
                f"rl.correction={self.correction} with rl.loss=tr_mask: the trust-region mask is "
                "itself the correction (it masks on π_θ/π_b); set rl.correction=none"
            )
        return self

    @property
    def advantage_mode(self) -> Literal["std", "mean"]:
        """The advantage collation uses: always ``mean`` under Dr. GRPO (no std division)."""
        return "mean" if self.loss == "dr_grpo" else self.advantage

    @property
    def wants_reference(self) -> bool:
        """True when the loss has a KL term, which needs the frozen reference policy."""
        return self.kl_coef > 0 and self.kl != "none"


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
