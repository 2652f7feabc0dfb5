"""Group-relative advantages (GRPO).

For a group of G completions of one prompt with rewards r_1..r_G::

    std:   A_i = (r_i − mean(r)) / (std(r) + 1e-6)      (population std, as in GRPO)
    mean:  A_i =  r_i − mean(r)                          (Dr.GRPO: no std division)

Every token of completion i gets A_i. Knows nothing about tokens, models or where rewards
come from.
"""

from __future__ import annotations

from typing import Literal

import torch

STD_EPS = 1e-6


def group_advantages(rewards: torch.Tensor, mode: Literal["std", "mean"] = "std") -> torch.Tensor:
    """Advantages of ``rewards`` ``[groups, G]`` (float), same shape."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, G], got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # [groups, G]
    if mode == "mean":
        return centred
    if mode == "std":
        return centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + STD_EPS)
    raise ValueError(f"unknown advantage mode {mode!r}")
