"""Training-health numbers and gradient-norm clipping.

    grad_norm = sqrt(Σ_params ‖g‖²)          (before clipping; logged every step)
    g ← g · min(1, max_norm / (grad_norm + 1e-6))

Entropy comes from :mod:`swarmrl.rl.logprobs`, the clip fraction from :mod:`swarmrl.rl.loss`.
Knows nothing about models beyond an iterable of parameters; with sharded parameters (DTensors)
the norm is the whole model's (``full_tensor`` gathers the partial norms).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Scale gradients so their global L2 norm is at most ``max_norm``; return the norm before."""
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor's norm is partial per rank
    if full_tensor is not None:
        norm = full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)
