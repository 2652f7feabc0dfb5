"""The policy-loss family besides the default two-sided clip (:mod:`swarmrl.rl.loss`).

Every loss here is per loss token: the caller sums ℓ·mask over the batch and divides by the
normaliser N of :func:`normaliser`. Notation, per token t of sequence i: ``logp`` = log π_θ,
``behaviour_logp`` = log π_b (the policy that generated the token, or the trainer's own
pre-update log-probs under an off-policy correction), ρ = exp(clamp(logp − behaviour_logp, −M,
M)), A = the sequence's advantage, m = the loss mask, |y_i| = Σ_t m (its loss tokens), sg = stop
gradient::

    clip     ℓ = max(−c1·A, −c2·A), c1 = clamp(ρ, 0, δ), c2 = clamp(c1, 1−ε_low, 1+ε_high)
             N = Σ m                                          (swarmrl.rl.loss; the default)
    dr_grpo  ℓ as clip, A = r − mean(r) (no std division)
             N = B · L_max                                    (no per-sequence or per-batch
                                                               length: L_max = max_new_tokens)
    dapo     ℓ = max(−ρ·A, −clamp(ρ, 1−ε_low, 1+ε_high)·A)   (decoupled clip, clip-higher)
             N = Σ m                                          (token-level)
    gspo     s_i = exp(clamp(Σ_t m·(logp − behaviour_logp) / |y_i|, −M, M))
             ℓ_i = max(−s_i·A_i, −clamp(s_i, 1−ε_low, 1+ε_high)·A_i);  ℓ_t = ℓ_i / |y_i|
             N = number of sequences                          (so L = mean over sequences of ℓ_i)
    cispo    ℓ = −sg(clamp(ρ, 1−ε_low, 1+ε_high))·A·logp      (REINFORCE, clipped IS weight)
             N = Σ m
    tr_mask  ℓ = −ρ·A·1[lo ≤ ρ ≤ hi]                          (no gradient outside the band)
             N = Σ m

Each function returns ``(ℓ, flagged)``: ``flagged`` is True where the token gets no gradient
from the policy term (the clipped branch won, or the token lies outside the band), which a run
logs as its clip fraction. Knows nothing about models or configs: it takes per-token tensors.
"""

from __future__ import annotations

from typing import Literal

import torch

LossName = Literal["clip", "dr_grpo", "dapo", "gspo", "cispo", "tr_mask"]


def dapo_token_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.28
) -> tuple[torch.Tensor, torch.Tensor]:
    """DAPO: ℓ = max(−ρA, −clamp(ρ, 1−ε_low, 1+ε_high)A), ε_high > ε_low lets unlikely tokens
    rise ("clip higher"); no δ cap. ``ratio`` and ``advantages`` broadcast, e.g. ``[B, T]``."""
    unclipped = -ratio * advantages
    clipped_branch = -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    return torch.maximum(unclipped, clipped_branch), clipped_branch > unclipped


def gspo_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    max_log_ratio: float = 10.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: one length-normalised ratio per sequence, clipped per sequence; each loss token
    carries ℓ_i/|y_i| so the masked sum over a sequence is ℓ_i. ``logp``, ``behaviour_logp``,
    ``mask`` ``[B, T]``; ``advantages`` ``[B, 1]``. ``flagged`` marks every token of a clipped
    sequence."""
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [B, 1]
    mean_log_ratio = ((logp - behaviour_logp) * mask).sum(dim=1, keepdim=True) / lengths
    seq_ratio = torch.exp(torch.clamp(mean_log_ratio, -max_log_ratio, max_log_ratio))  # [B, 1]
    unclipped = -seq_ratio * advantages
    clipped_branch = -torch.clamp(seq_ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    seq_loss = torch.maximum(unclipped, clipped_branch)  # [B, 1]
    flagged = (clipped_branch > unclipped).expand_as(logp)
    return (seq_loss / lengths).expand_as(logp), flagged


def cispo_token_loss(
    logp: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: ℓ = −sg(clamp(ρ, 1−ε_low, 1+ε_high))·A·logp. Unlike a clipped PPO loss every
    token keeps a gradient (the weight is clipped, not the term); ``flagged`` marks where the
    weight was clipped. ε_low = 1 (the default) leaves no lower bound."""
    weight = ratio.detach()
    clipped_weight = torch.clamp(weight, 1.0 - eps_low, 1.0 + eps_high)
    return -clipped_weight * advantages * logp, clipped_weight != weight


def trust_region_token_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float = 0.125, high: float = 8.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trust-region mask: ℓ = −ρ·A where lo ≤ ρ ≤ hi, 0 (no gradient) outside the band, with ρ
    the trainer/inference ratio. ``flagged`` marks the tokens outside the band."""
    outside = (ratio < low) | (ratio > high)
    return torch.where(outside, torch.zeros_like(ratio), -ratio * advantages), outside


def normaliser(loss: LossName, loss_tokens: float, sequences: float, max_len: int) -> float:
    """N of the module docstring: the batch's loss tokens, its sequences × ``max_len`` (Dr.
    GRPO) or its sequences (GSPO); at least 1."""
    if loss == "dr_grpo":
        return max(sequences * max_len, 1.0)
    if loss == "gspo":
        return max(sequences, 1.0)
    return max(loss_tokens, 1.0)
