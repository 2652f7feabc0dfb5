"""Training-health numbers and gradient-norm clipping.

    grad_norm = sqrt(Σ_params ‖g‖²)          (before clipping; logged every step)
    g ← g · min(1, max_norm / (grad_norm + 1e-6))

Entropy comes from :mod:`swarmrl.rl.logprobs`, the clip fraction from :mod:`swarmrl.rl.loss`.
Knows nothing about models beyond an iterable of parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Scale gradients so their global L2 norm is at most ``max_norm``; return the norm before."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    return float(norm)
