"""Off-policy correction: a per-token weight for the mismatch between the policy that sampled a
token (behaviour, π_b: an inference engine, maybe an older version, other kernels) and the
trainer's own log-probs of it before the update (π_old, no gradient).

Per loss token t of sequence i, with r_t = π_old/π_b = exp(clamp(old_logp − behaviour_logp,
−M, M)) and the sequence ratio R_i = exp(clamp(Σ_t m·(old_logp − behaviour_logp), −M, M))::

    none           w = 1                                      (the loss's ratio is π_θ/π_b)
    tis_token      w_t = min(r_t, cap)                        (truncated importance sampling)
    tis_sequence   w_t = min(R_i, cap)
    mask_token     w_t = 1[a ≤ r_t ≤ b]
    mask_sequence  w_t = 1[a ≤ R_i ≤ b]

Per sample age: with the sample's age k_i (versions: the version being trained − the version
that generated it, its *staleness*) and a decay γ ∈ [0, 1], the bounds used for sequence i are

    s_i = γ^k_i,   cap_i = cap^s_i,   a_i = a^s_i,   b_i = b^s_i

so every bound moves toward 1 in log space as the sample ages (log cap_i = s_i · log cap):
with γ = 1 (the default) age changes nothing; with γ = 0.5 and cap 2, a sample one version old
is capped at √2 ≈ 1.41 and one two versions old at 2^¼ ≈ 1.19; with γ = 0 a sample of age ≥ 1 is
capped at 1 (tis: only its down-weighting survives) or kept only where its ratio is exactly 1
(mask). The ratio of an older sample carries the trainer's drift since that version as well as
the engines' difference, so its weight is trusted less.

Under any correction but ``none`` the loss takes its ratio against π_old instead of π_b (ρ =
π_θ/π_old: the trust region is around the trainer's policy), and the step's token loss becomes
w·ℓ. The mismatch itself is logged whatever the correction:

    mismatch_kl = mean over loss tokens of r − 1 − log r      (k3 estimate of KL(π_b ‖ π_old),
                                                               unbiased on tokens drawn from π_b)

Knows nothing about models or configs: it takes per-token tensors.
"""

from __future__ import annotations

from typing import Literal

import torch

CorrectionName = Literal["none", "tis_token", "tis_sequence", "mask_token", "mask_sequence"]


def correction_weights(
    kind: CorrectionName,
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 2.0,
    band: tuple[float, float] = (0.5, 2.0),
    max_log_ratio: float = 10.0,
    age: torch.Tensor | None = None,
    decay: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, corrected)``, both ``[B, T]`` like the inputs: the weights of the module docstring
    (no gradient) and a bool marking the tokens truncated (w < r) or masked out (w = 0).
    ``age``: ``[B, 1]`` versions per sample (None: all 0); ``decay``: γ of the per-age bounds."""
    log_r = (old_logp - behaviour_logp).detach()  # [B, T]
    if kind == "none":
        return torch.ones_like(log_r), torch.zeros_like(log_r, dtype=torch.bool)
    if kind.endswith("_sequence"):
        log_r = (log_r * mask).sum(dim=1, keepdim=True).expand_as(log_r)  # R_i on every token
    ratio = torch.exp(torch.clamp(log_r, -max_log_ratio, max_log_ratio))
    if age is None:
        age = torch.zeros((log_r.shape[0], 1), dtype=log_r.dtype, device=log_r.device)
    scale = torch.pow(decay, age.to(log_r.dtype))  # [B, 1]
    if kind.startswith("tis_"):
        cap_i = torch.pow(cap, scale)  # [B, 1]
        return torch.minimum(ratio, cap_i), ratio > cap_i
    if kind.startswith("mask_"):
        low_i = torch.pow(band[0], scale)  # [B, 1]
        high_i = torch.pow(band[1], scale)
        outside = (ratio < low_i) | (ratio > high_i)
        return (~outside).to(ratio.dtype), outside
    raise ValueError(f"unknown correction {kind!r}")


def mismatch_kl(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, max_log_ratio: float = 10.0
) -> torch.Tensor:
    """Per-token k3 estimate r − 1 − log r of KL(π_b ‖ π_old), r = π_old/π_b; no gradient."""
    log_r = torch.clamp((old_logp - behaviour_logp).detach(), -max_log_ratio, max_log_ratio)
    return torch.exp(log_r) - 1.0 - log_r
