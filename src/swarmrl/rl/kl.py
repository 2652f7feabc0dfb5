"""KL penalty to a reference policy, with a real gradient: the k1, k3 and squared estimators.

Per token, with d = ref_logp − logp (log-probs of the sampled token, clamped to [−M, M])::

    k1      = −d                   unbiased for KL(π_θ ‖ π_ref) on tokens from π_θ; can be < 0
    k3      = exp(d) − d − 1       ≥ 0, unbiased for KL(π_θ ‖ π_ref) on tokens from π_θ
    squared = d² / 2               ≥ 0, biased; its gradient is the log-ratio itself (k2)

The gradient flows through ``logp`` (the reference is a constant), so the term actually pulls the
policy toward the reference instead of only being logged. Knows nothing about models.
"""

from __future__ import annotations

from typing import Literal

import torch

KLName = Literal["none", "k1", "k3", "squared"]


def _log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor, max_log_ratio: float) -> torch.Tensor:
    return torch.clamp(ref_logp.detach() - logp, -max_log_ratio, max_log_ratio)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, max_log_ratio: float = 10.0) -> torch.Tensor:
    """Per-token k3 estimate, same shape as ``logp``; ``ref_logp`` gets no gradient."""
    d = _log_ratio(logp, ref_logp, max_log_ratio)
    return torch.exp(d) - d - 1.0


def kl_penalty(
    kind: KLName, logp: torch.Tensor, ref_logp: torch.Tensor, max_log_ratio: float = 10.0
) -> torch.Tensor:
    """Per-token estimate ``kind`` of the module docstring (zeros for ``none``)."""
    if kind == "none":
        return torch.zeros_like(logp)
    if kind == "k3":
        return k3_kl(logp, ref_logp, max_log_ratio)
    d = _log_ratio(logp, ref_logp, max_log_ratio)
    if kind == "k1":
        return -d
    if kind == "squared":
        return 0.5 * d * d
    raise ValueError(f"unknown KL estimator {kind!r}")
