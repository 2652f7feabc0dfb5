"""KL penalty to a reference policy: the k3 estimator, with a real gradient.

Per token, with d = ref_logp − logp (log-probs of the sampled token)::

    k3 = exp(d) − d − 1        ≥ 0, unbiased for KL(π_θ ‖ π_ref) when tokens come from π_θ

The gradient flows through ``logp`` (the reference is a constant), so the term actually pulls the
policy toward the reference instead of only being logged. Knows nothing about models.
"""

from __future__ import annotations

import torch


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, max_log_ratio: float = 10.0) -> torch.Tensor:
    """Per-token k3 estimate, same shape as ``logp``; ``ref_logp`` gets no gradient."""
    d = torch.clamp(ref_logp.detach() - logp, -max_log_ratio, max_log_ratio)
    return torch.exp(d) - d - 1.0
