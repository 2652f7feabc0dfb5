"""Length-budget ("thinking budget") wrapper around any environment.

Each task gets a target length ``t`` drawn deterministically (from its problem id) out of a
set of targets, and an instruction naming it in front of the prompt. With ``r_task`` the inner
reward and ``l`` the completion length (tokens when the caller passes them, else characters)::

    exact:  r = clamp(r_task − α·|t − l|, 0, 1)
    max:    r = clamp(r_task − α·max(0, l − t), 0, 1)       (only overshoot costs)
    clip:   r = r_task · clamp(1 − α·|t − l|, 0, 1)         (penalty never exceeds r_task)

The instruction is compact (``[t]``) for character-vocabulary tasks and a sentence otherwise.

Knows nothing about tokens beyond the count it may be given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from swarmrl.envs.base import Environment, Score, Split, Task

BudgetMode = Literal["exact", "max", "clip"]


def budget_reward(r_task: float, target: int, length: int, alpha: float, mode: BudgetMode) -> float:
    """The shaped reward of the module docstring."""
    gap = abs(target - length)
    if mode == "exact":
        shaped = r_task - alpha * gap
    elif mode == "max":
        shaped = r_task - alpha * max(0, length - target)
    elif mode == "clip":
        shaped = r_task * min(1.0, max(0.0, 1.0 - alpha * gap))
    else:
        raise ValueError(f"unknown length-budget mode {mode!r}")
    return min(1.0, max(0.0, shaped))


class LengthBudgetEnv(Environment):
    """``inner`` with a per-task target length, an instruction naming it, and a shaped reward."""

    def __init__(
        self,
        inner: Environment,
        targets: Sequence[int],
        alpha: float = 3e-4,
        mode: BudgetMode = "exact",
    ) -> None:
        super().__init__(inner.heldout_fraction)
        if not targets or any(t <= 0 for t in targets):
            raise ValueError(f"length targets must be positive integers, got {list(targets)}")
        self.inner = inner
        self.targets = tuple(targets)
        self.alpha = alpha
        self.mode: BudgetMode = mode
        self.name = f"{inner.name}+budget"
        self.prose = inner.prose or inner.alphabet is None
        extra = "Answer in about tokens.\n0123456789" if self.prose else "[]0123456789"
        self.alphabet = None if inner.alphabet is None else inner.alphabet + extra

    def space_size(self) -> int:
        return self.inner.space_size()

    def problem(self, problem_id: int) -> tuple[str, str]:
        return self.inner.problem(problem_id)

    def record(self, problem_id: int) -> dict[str, Any]:
        return self.inner.record(problem_id)

    def problem_id(self, split: Split, index: int) -> int:
        return self.inner.problem_id(split, index)

    def split_size(self, split: Split) -> int:
        return self.inner.split_size(split)

    def target_for(self, problem_id: int) -> int:
        # A fixed odd multiplier scatters neighbouring ids over the targets.
        return self.targets[(problem_id * 2654435761) % (2**32) % len(self.targets)]

    def instruction(self, target: int) -> str:
        if self.prose:
            return f"Answer in about {target} tokens.\n"
        return f"[{target}]"

    def task(self, split: Split, index: int) -> Task:
        inner = self.inner.task(split, index)
        target = self.target_for(inner.problem_id)
        return Task(
            problem_id=inner.problem_id,
            split=inner.split,
            index=inner.index,
            prompt=self.instruction(target) + inner.prompt,
            answer=inner.answer,
            meta={**inner.meta, "target_length": target},
            system=inner.system,
        )

    def demonstration(self, task: Task, flawed: bool = False) -> str:
        return self.inner.demonstration(task, flawed)

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        inner = self.inner.score(task, completion_text, num_tokens)
        target = int(task.meta["target_length"])
        length = num_tokens if num_tokens is not None else len(completion_text)
        reward = budget_reward(inner.reward, target, length, self.alpha, self.mode)
        return Score(
            reward=reward,
            details={
                **inner.details,
                "task_reward": inner.reward,
                "length": length,
                "target_length": target,
            },
        )
