"""Rollouts as the trainer sees them, and their collation into padded tensors.

A :class:`Group` is G completions of one prompt with their rewards and the log-probs the
behaviour policy (the version that generated them) gave each sampled token. :func:`collate`
turns groups into one right-padded batch::

    input_ids       [B, T]     prompt + output + pad
    loss_mask       [B, T-1]   1 where position j predicts a sampled output token (j+1 is
                               output, and the policy sampled it: an episode's environment
                               tokens are output but never loss tokens)
    behaviour_logp  [B, T-1]   behaviour log-prob of that token (0 elsewhere)
    advantages      [B, 1]     group advantage of the sequence (every token shares it)
    age             [B, 1]     versions between the one trained and the one that generated
                               the sequence (its staleness; 0 when collated without a version)

Knows nothing about how rollouts were produced (colocated engine or a swarm of workers).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from swarmrl.envs import Task
from swarmrl.rl import group_advantages


@dataclass
class Completion:
    """One sampled completion: tokens, behaviour log-probs (one per sampled token), reward.

    An episode's sample (``swarmrl.trainer.episodes``) also holds environment tokens among its
    output tokens: ``model_mask`` [len(output_tokens)] says which the policy sampled (None: all
    of them), and ``behaviour_logprobs`` has one value per sampled token. ``continues``: this
    sample is a later segment of the completion before it (same episode, same reward), not a
    group member of its own.
    """

    prompt_tokens: list[int]
    output_tokens: list[int]
    behaviour_logprobs: list[float]
    reward: float
    policy_version: int = 0
    correct: bool = False
    text: str = ""
    model_mask: list[bool] | None = None
    continues: bool = False

    @property
    def sampled_tokens(self) -> int:
        """Output tokens the policy sampled (environment tokens excluded)."""
        return len(self.output_tokens) if self.model_mask is None else sum(self.model_mask)


@dataclass
class Group:
    """The G completions of one task."""

    task: Task
    completions: list[Completion] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        """One per member (an episode split into segments is one member)."""
        return [c.reward for c in self.completions if not c.continues]


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T-1] float
    behaviour_logp: torch.Tensor  # [B, T-1] float
    advantages: torch.Tensor  # [B, 1] float
    age: torch.Tensor | None = None  # [B, 1] float versions of staleness; None: all 0

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: str | torch.device) -> TrainBatch:
        return TrainBatch(
            self.input_ids.to(device),
            self.loss_mask.to(device),
            self.behaviour_logp.to(device),
            self.advantages.to(device),
            None if self.age is None else self.age.to(device),
        )

    def rows(self, start: int, stop: int) -> TrainBatch:
        return TrainBatch(
            self.input_ids[start:stop],
            self.loss_mask[start:stop],
            self.behaviour_logp[start:stop],
            self.advantages[start:stop],
            None if self.age is None else self.age[start:stop],
        )


def collate(
    groups: Sequence[Group],
    pad_id: int,
    advantage: Literal["std", "mean"] = "std",
    policy_version: int | None = None,
) -> TrainBatch:
    """One padded batch of every completion of ``groups`` (groups must be the same size);
    ``policy_version``: the version being trained, which sets each row's ``age``."""
    sizes = {len(g.rewards) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups must all have the same size, got sizes {sorted(sizes)}")
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [groups, G]
    member_adv = group_advantages(rewards, advantage).reshape(-1).tolist()  # [groups·G]
    completions = [c for g in groups for c in g.completions]
    if any(g.completions[0].continues for g in groups if g.completions):
        raise ValueError("a group's first completion cannot continue another")
    # every segment of an episode shares its member's advantage
    member_of = list(itertools.accumulate(0 if c.continues else 1 for c in completions))
    adv = torch.tensor([[member_adv[m - 1]] for m in member_of], dtype=torch.float32)  # [B, 1]
    width = max(len(c.prompt_tokens) + len(c.output_tokens) for c in completions)
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(completions), width - 1), dtype=torch.float32)
    behaviour = torch.zeros((len(completions), width - 1), dtype=torch.float32)
    for i, c in enumerate(completions):
        if len(c.behaviour_logprobs) != c.sampled_tokens:
            raise ValueError(f"completion {i}: one behaviour log-prob per sampled token needed")
        p, n = len(c.prompt_tokens), len(c.output_tokens)
        ids[i, : p + n] = torch.tensor(c.prompt_tokens + c.output_tokens)
        sampled = torch.ones(n) if c.model_mask is None else torch.tensor(c.model_mask).float()
        if c.model_mask is not None and len(c.model_mask) != n:
            raise ValueError(f"completion {i}: one model_mask entry per output token needed")
        mask[i, p - 1 : p - 1 + n] = sampled
        behaviour[i, p - 1 : p - 1 + n][sampled.bool()] = torch.tensor(c.behaviour_logprobs)
    age = None
    if policy_version is not None:
        age = torch.tensor([[float(policy_version - c.policy_version)] for c in completions])
    return TrainBatch(ids, mask, behaviour, adv, age)
