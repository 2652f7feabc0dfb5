"""The two-sided clipped policy loss with global token-level normalization.

Per loss token, with log-probs under the current policy (``logp``) and under the behaviour
policy that generated the token (``behaviour_logp``)::

    ρ   = exp(clamp(logp − behaviour_logp, −M, M))        (clamped before exp: always finite)
    c1  = clamp(ρ, 0, δ)
    c2  = clamp(c1, 1 − ε_low, 1 + ε_high)
    ℓ   = max(−c1·A, −c2·A)

The δ cap bounds the loss for negative advantages, where plain PPO clipping (ℓ = max(−ρA,
−clip(ρ)A)) grows without bound as ρ grows. The batch loss is

    L = Σ_tokens ℓ · mask / Σ_tokens mask                 (over the whole batch, not per sequence)

so every loss token weighs the same however long its sequence (``swarmrl.trainer.step`` sums
ℓ·mask over micro-batches and divides by the loss tokens of the whole batch). The clip fraction
a run logs is the share of loss tokens where the clipped branch won (its gradient is zero
there).

Knows nothing about models: it takes per-token tensors.
"""

from __future__ import annotations

import torch


def importance_ratio(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, max_log_ratio: float = 10.0
) -> torch.Tensor:
    """ρ = exp(clamp(logp − behaviour_logp, −M, M)); any shape."""
    return torch.exp(torch.clamp(logp - behaviour_logp, -max_log_ratio, max_log_ratio))


def clipped_token_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    delta: float = 4.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(ℓ, clipped)``; ``ratio`` and ``advantages`` broadcast, e.g. ``[B, T]``.

    ``clipped`` is a bool tensor: True where −c2·A > −c1·A (the clipped branch is taken).
    """
    c1 = torch.clamp(ratio, 0.0, delta)
    c2 = torch.clamp(c1, 1.0 - eps_low, 1.0 + eps_high)
    unclipped = -c1 * advantages
    clipped_branch = -c2 * advantages
    return torch.maximum(unclipped, clipped_branch), clipped_branch > unclipped
