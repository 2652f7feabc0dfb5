"""One policy-gradient optimizer step on a batch of rollouts (the same in every mode).

    logp, H  = chunked per-token log-probs and entropy of the current policy (temperature τ)
    old      = behaviour_logp, or with an off-policy correction the trainer's own logp (no grad)
    ℓ        = rl.loss(logp, old, A)              (swarmrl.rl.loss / swarmrl.rl.losses; default:
                                                   the two-sided clip of ρ = π_θ/π_b)
    ℓ        ← w · ℓ  +  β · KL(logp, ref_logp)   (w: rl.correction, swarmrl.rl.correction,
                                                   its bounds tightened by each row's age)
    L        = Σ ℓ·mask / N                       (over the whole batch; N = Σ mask but for
                                                   dr_grpo and gspo, swarmrl.rl.losses)
    g        = ∇L, clipped to global norm ``grad_clip``; AdamW step

Micro-batches accumulate gradients of Σ ℓ·mask, divided by N of the *whole* batch once it is
complete, so the result equals one pass over the full batch, however the batch
was cut and whenever its parts came (:class:`StepAccumulator`: a trainer whose batch arrives in
parts computes each part's gradients while it waits for the rest). Returns the numbers a run
logs per step.

Data parallel: each rank passes its slice of the batch and ``all_sum`` (a sum over ranks,
:meth:`swarmrl.trainer.parallel.Parallel.all_sum`); the loss-token count and the logged sums
are then those of the whole batch, and gradients are summed across ranks by the sharding.

Knows nothing about where rollouts came from or how weights are published.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from swarmrl.config.rl import RLConfig
from swarmrl.rl import (
    cispo_token_loss,
    clip_grad_norm,
    clipped_token_loss,
    correction_weights,
    dapo_token_loss,
    gspo_token_loss,
    importance_ratio,
    kl_penalty,
    mismatch_kl,
    normaliser,
    token_logprobs,
    trust_region_token_loss,
)
from swarmrl.trainer.batch import TrainBatch


@dataclass
class StepStats:
    loss: float
    clip_fraction: float
    grad_norm: float
    entropy: float
    kl: float
    loss_tokens: int
    mismatch_kl: float = 0.0  # mean k3 of KL(π_b ‖ π_old) over loss tokens (swarmrl.rl.correction)
    corrected_fraction: float = 0.0  # share of loss tokens the correction truncated or masked


def _this_process(values: torch.Tensor) -> torch.Tensor:
    return values


def policy_token_loss(
    rl: RLConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(ℓ, flagged)`` of ``rl.loss`` with its ratio against ``old_logp``; all
    ``[b, T-1]`` but ``advantages`` ``[b, 1]``. ``flagged``: no gradient from the policy term."""
    if rl.loss == "gspo":
        return gspo_token_loss(
            logp, old_logp, advantages, mask, rl.eps_low, rl.eps_high, rl.max_log_ratio
        )
    ratio = importance_ratio(logp, old_logp, rl.max_log_ratio)
    if rl.loss in ("clip", "dr_grpo"):
        return clipped_token_loss(ratio, advantages, rl.eps_low, rl.eps_high, rl.delta)
    if rl.loss == "dapo":
        return dapo_token_loss(ratio, advantages, rl.eps_low, rl.eps_high)
    if rl.loss == "cispo":
        return cispo_token_loss(logp, ratio, advantages, rl.eps_low, rl.eps_high)
    if rl.loss == "tr_mask":
        return trust_region_token_loss(ratio, advantages, rl.tr_low, rl.tr_high)
    raise ValueError(f"unknown rl.loss {rl.loss!r}")


def make_optimizer(model: PreTrainedModel, rl: RLConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (with LoRA: the adapters only)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=rl.lr, weight_decay=rl.weight_decay)


class StepAccumulator:
    """One optimizer step whose batch is added in parts (rows of whole groups: advantages are
    per group), the gradients of each computed when it is added; :meth:`finish` steps."""

    def __init__(
        self,
        model: PreTrainedModel,
        optimizer: torch.optim.Optimizer,
        rl: RLConfig,
        reference: PreTrainedModel | None = None,
        micro_batch: int = 256,
    ) -> None:
        self.model, self.optimizer, self.rl = model, optimizer, rl
        self.reference, self.micro_batch = reference, micro_batch
        self.loss_tokens = 0  # this process's, over the parts added so far
        self.sequences = 0  # rows with at least one loss token, likewise
        self._sums = {
            "loss": 0.0,
            "clipped": 0.0,
            "entropy": 0.0,
            "kl": 0.0,
            "mismatch_kl": 0.0,
            "corrected": 0.0,
        }
        optimizer.zero_grad(set_to_none=True)

    def add(self, batch: TrainBatch) -> None:
        """Backpropagate Σ ℓ·mask over ``batch``'s rows (module docstring)."""
        rl, sums = self.rl, self._sums
        self.model.train()  # until finish: nothing else runs the model while a batch is awaited
        for start in range(0, batch.input_ids.shape[0], self.micro_batch):
            mb = batch.rows(start, start + self.micro_batch)
            logp, entropy = token_logprobs(
                self.model,
                mb.input_ids,
                chunk=rl.logprob_chunk,
                temperature=rl.sampling.temperature,
                with_entropy=True,
            )  # [b, T-1] each
            corrected = rl.correction != "none"
            old_logp = logp.detach() if corrected else mb.behaviour_logp
            token_loss, clipped = policy_token_loss(rl, logp, old_logp, mb.advantages, mb.loss_mask)
            weight, truncated = correction_weights(
                rl.correction,
                logp,
                mb.behaviour_logp,
                mb.loss_mask,
                rl.correction_cap,
                (rl.correction_low, rl.correction_high),
                rl.max_log_ratio,
                mb.age,
                rl.correction_decay,
            )
            if corrected:
                token_loss = weight * token_loss
            kl = torch.zeros_like(token_loss)
            if self.reference is not None and rl.wants_reference:
                with torch.no_grad():
                    ref_logp, _ = token_logprobs(
                        self.reference,
                        mb.input_ids,
                        chunk=rl.logprob_chunk,
                        temperature=rl.sampling.temperature,
                    )
                kl = kl_penalty(rl.kl, logp, ref_logp, rl.max_log_ratio)
                token_loss = token_loss + rl.kl_coef * kl
            loss = (token_loss * mb.loss_mask).sum()
            loss.backward()
            sums["loss"] += float(loss.detach())
            sums["clipped"] += float((clipped.float() * mb.loss_mask).sum())
            sums["entropy"] += float((entropy * mb.loss_mask).sum())  # type: ignore[operator]
            sums["kl"] += float((kl.detach() * mb.loss_mask).sum())
            mismatch = mismatch_kl(logp, mb.behaviour_logp, rl.max_log_ratio)
            sums["mismatch_kl"] += float((mismatch * mb.loss_mask).sum())
            sums["corrected"] += float((truncated.float() * mb.loss_mask).sum())
        self.loss_tokens += batch.loss_tokens
        self.sequences += int((batch.loss_mask.sum(dim=1) > 0).sum())

    def finish(self, all_sum: Callable[[torch.Tensor], torch.Tensor] = _this_process) -> StepStats:
        """Divide the gradients by the whole batch's N (over ranks), clip, step."""
        counts = all_sum(torch.tensor([float(self.loss_tokens), float(self.sequences)]))
        loss_tokens, sequences = int(counts[0]), int(counts[1])
        total_tokens = max(loss_tokens, 1)
        norm = normaliser(self.rl.loss, loss_tokens, sequences, self.rl.sampling.max_new_tokens)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(norm)
        grad_norm = clip_grad_norm(self.model.parameters(), self.rl.grad_clip)
        self.optimizer.step()
        self.model.eval()
        total = all_sum(torch.tensor(list(self._sums.values()), dtype=torch.float64)).tolist()
        loss, clipped, entropy_sum, kl_sum, mismatch_sum, corrected_sum = total
        return StepStats(
            loss=loss / norm,
            clip_fraction=clipped / total_tokens,
            grad_norm=grad_norm,
            entropy=entropy_sum / total_tokens,
            kl=kl_sum / total_tokens,
            loss_tokens=loss_tokens,
            mismatch_kl=mismatch_sum / total_tokens,
            corrected_fraction=corrected_sum / total_tokens,
        )


def policy_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    rl: RLConfig,
    reference: PreTrainedModel | None = None,
    micro_batch: int = 256,
    all_sum: Callable[[torch.Tensor], torch.Tensor] = _this_process,
) -> StepStats:
    """Compute the loss over ``batch``, backpropagate, clip, step. See the module docstring."""
    step = StepAccumulator(model, optimizer, rl, reference, micro_batch)
    step.add(batch)
    return step.finish(all_sum)
