"""Which groups and tasks are worth training on.

Online filter: a group whose rewards are all equal has zero advantage for every completion, so
it contributes no gradient; drop it and sample more groups until the batch is full::

    informative(group) ⇔ max(r) > min(r)

:func:`is_informative` is that rule, the only copy: the colocated sampler (through
:func:`fill_with_informative`) and the swarm trainer's batch collector both call it.

Offline filter: keep a task when its pass rate p (share of k sampled completions that are
correct under the base model) lies in [lo, hi]; tasks always or never solved teach nothing.

Knows nothing about models or sampling: the caller passes a function that samples groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch


class HasRewards(Protocol):
    rewards: Sequence[float]


G = TypeVar("G", bound=HasRewards)


def is_informative(rewards: Sequence[float]) -> bool:
    """True when a group's rewards are not all equal (its advantages are not all zero)."""
    return max(rewards) > min(rewards)


def fill_with_informative(
    sample: Callable[[int, int], list[G]], need: int, max_extra_rounds: int
) -> tuple[list[G], int]:
    """Keep informative groups from ``sample(n, round)`` until ``need`` are kept.

    Round 0 asks for ``need`` groups; each later round (at most ``max_extra_rounds``) asks for
    the missing number. Returns ``(kept[:need], groups_sampled)``; ``kept`` may be short when
    the rounds run out (the caller trains on what there is, or skips an empty batch).
    """
    kept: list[G] = []
    sampled = 0
    for round_ in range(max_extra_rounds + 1):
        missing = need - len(kept)
        if missing <= 0:
            break
        groups = sample(missing, round_)
        sampled += len(groups)
        kept += [g for g in groups if is_informative(g.rewards)]
    return kept[:need], sampled


def pass_rate_mask(pass_rates: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Bool mask of tasks whose pass rate lies in ``[lo, hi]``."""
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"need 0 <= lo <= hi <= 1, got lo={lo}, hi={hi}")
    return (pass_rates >= lo) & (pass_rates <= hi)
