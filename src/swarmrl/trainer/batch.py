"""Rollouts as the trainer sees them, and their collation into padded tensors.

A :class:`Group` is G completions of one prompt with their rewards and the log-probs the
behaviour policy (the version that generated them) gave each sampled token. :func:`collate`
turns groups into one right-padded batch::

    input_ids       [B, T]     prompt + output + pad
    loss_mask       [B, T-1]   1 where position j predicts an output token (j+1 is output)
    behaviour_logp  [B, T-1]   behaviour log-prob of that token (0 elsewhere)
    advantages      [B, 1]     group advantage of the sequence (every token shares it)

Knows nothing about how rollouts were produced (colocated engine or a swarm of workers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from swarmrl.envs import Task
from swarmrl.rl import group_advantages


@dataclass
class Completion:
    """One sampled completion: tokens, behaviour log-probs (one per output token), reward."""

    prompt_tokens: list[int]
    output_tokens: list[int]
    behaviour_logprobs: list[float]
    reward: float
    policy_version: int = 0
    correct: bool = False
    text: str = ""


@dataclass
class Group:
    """The G completions of one task."""

    task: Task
    completions: list[Completion] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T-1] float
    behaviour_logp: torch.Tensor  # [B, T-1] float
    advantages: torch.Tensor  # [B, 1] float

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: str | torch.device) -> TrainBatch:
        return TrainBatch(
            self.input_ids.to(device),
            self.loss_mask.to(device),
            self.behaviour_logp.to(device),
            self.advantages.to(device),
        )

    def rows(self, start: int, stop: int) -> TrainBatch:
        return TrainBatch(
            self.input_ids[start:stop],
            self.loss_mask[start:stop],
            self.behaviour_logp[start:stop],
            self.advantages[start:stop],
        )


def collate(
    groups: Sequence[Group], pad_id: int, advantage: Literal["std", "mean"] = "std"
) -> TrainBatch:
    """One padded batch of every completion of ``groups`` (groups must be the same size)."""
    sizes = {len(g.completions) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups must all have the same size, got sizes {sorted(sizes)}")
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [groups, G]
    adv = group_advantages(rewards, advantage).reshape(-1, 1)  # [B, 1]
    completions = [c for g in groups for c in g.completions]
    width = max(len(c.prompt_tokens) + len(c.output_tokens) for c in completions)
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(completions), width - 1), dtype=torch.float32)
    behaviour = torch.zeros((len(completions), width - 1), dtype=torch.float32)
    for i, c in enumerate(completions):
        if len(c.behaviour_logprobs) != len(c.output_tokens):
            raise ValueError(f"completion {i}: one behaviour log-prob per output token needed")
        p, n = len(c.prompt_tokens), len(c.output_tokens)
        ids[i, : p + n] = torch.tensor(c.prompt_tokens + c.output_tokens)
        mask[i, p - 1 : p - 1 + n] = 1.0
        behaviour[i, p - 1 : p - 1 + n] = torch.tensor(c.behaviour_logprobs)
    return TrainBatch(ids, mask, behaviour, adv)
