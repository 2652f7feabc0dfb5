"""``reasoning_gym``: procedural reasoning tasks from the ``reasoning-gym`` library, generated
locally and scored by the library's own ``score_answer``.

``env.tasks`` names the generators, each with a weight and its config keywords; ``env.size``
problems are made with ``env.seed``. Problem ``i`` belongs to one generator, picked by a
weighted draw seeded by ``(env.seed, i)``, and is that generator's item ``i`` (reasoning-gym
items are a pure function of seed and index), so every process that builds the same config sees
the same problems, and the base split (a permutation of the ids) stays disjoint and
reproducible. Different ids can still produce the same question text when a generator's own
space is small; widen its config (or lower ``env.size``) for such generators.

The prompt asks for the answer between ``<answer>`` and ``</answer>``; the reward is the
library's score of the last such answer (0 without one), clipped to [0, 1]. ``correct`` means a
score of 1. Some generators give partial credit to a wrong answer that contains the right one
(``basic_arithmetic`` scores ``20`` for ``2`` at 0.5); with ``partial_credit=False`` the reward
is 1 for a correct answer and 0 otherwise. Unknown generator names and bad config keywords are
a one-line :class:`ConfigError` at start-up.

Knows nothing about tokens or models.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from swarmrl.config.env import ReasoningGymTask
from swarmrl.envs.base import Environment, Score, Task
from swarmrl.envs.data import require
from swarmrl.errors import ConfigError

INSTRUCTION = "\nGive your final answer between <answer> and </answer>.\n"
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def last_answer(text: str) -> str | None:
    found = ANSWER.findall(text)
    return found[-1].strip() if found else None


class ReasoningGymEnv(Environment):
    """``size`` problems drawn from weighted reasoning-gym generators. The built-in tiny model
    for them reads printable ASCII (the generators write English prose and ASCII notation; a
    prompt outside it is refused at start, naming the characters)."""

    name = "reasoning_gym"
    alphabet = string.printable

    def __init__(
        self,
        tasks: Sequence[ReasoningGymTask],
        size: int = 10000,
        seed: int = 0,
        heldout_fraction: float = 0.1,
        partial_credit: bool = True,
    ) -> None:
        super().__init__(heldout_fraction)
        self.partial_credit = partial_credit
        rg = require("reasoning_gym", "env.name = 'reasoning_gym'")
        if not tasks:
            raise ConfigError("env.name = 'reasoning_gym' needs env.tasks (generator names)")
        from reasoning_gym.factory import DATASETS

        self.size, self.seed = size, seed
        self.generators: list[Any] = []
        for spec in tasks:
            if spec.name not in DATASETS:
                raise ConfigError(
                    f"env.tasks: unknown reasoning-gym task {spec.name!r} "
                    f"(e.g. {', '.join(sorted(DATASETS)[:6])}, ...)"
                )
            try:
                self.generators.append(
                    rg.create_dataset(spec.name, size=size, seed=seed, **spec.config)
                )
            except (TypeError, ValueError, AssertionError) as exc:
                raise ConfigError(f"env.tasks: reasoning-gym task {spec.name!r}: {exc}") from exc
        self.task_names = [spec.name for spec in tasks]
        self.weights = [spec.weight for spec in tasks]

    def space_size(self) -> int:
        return self.size

    def generator_of(self, problem_id: int) -> int:
        """Which generator makes problem ``problem_id`` (weighted, seeded by the id)."""
        rng = random.Random(f"{self.seed}:{problem_id}")
        return rng.choices(range(len(self.weights)), weights=self.weights)[0]

    @lru_cache(maxsize=4096)  # noqa: B019 - entries are pure functions of the id
    def entry(self, problem_id: int) -> dict[str, Any]:
        return dict(self.generators[self.generator_of(problem_id)][problem_id])

    def problem(self, problem_id: int) -> tuple[str, str]:
        entry = self.entry(problem_id)
        return str(entry["question"]) + INSTRUCTION, str(entry["answer"])

    def record(self, problem_id: int) -> dict[str, Any]:
        entry = self.entry(problem_id)
        return {
            "problem": entry["question"],
            "answer": entry["answer"],
            "task": self.task_names[self.generator_of(problem_id)],
        }

    def demonstration(self, task: Task, flawed: bool = False) -> str:
        """The generator's answer in the tags. A flawed demonstration (``sft.label_noise``) is
        the answer with its leading minus sign forgotten: like arith's forgotten final carry,
        a mistake on some problems only (negative answers), which continued imitation of the
        noisy data keeps making and RL, rewarded on the library's score, can unlearn."""
        answer = task.answer
        if flawed and answer.startswith("-") and len(answer) > 1:
            answer = answer[1:]
        return f"<answer>{answer}</answer>"

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        answer = last_answer(completion_text)
        name = self.task_names[self.generator_of(task.problem_id)]
        if answer is None:
            return Score(0.0, {"correct": False, "task": name})
        generator = self.generators[self.generator_of(task.problem_id)]
        raw = float(generator.score_answer(answer=answer, entry=self.entry(task.problem_id)))
        reward = min(1.0, max(0.0, raw)) if raw == raw else 0.0  # NaN scores count as 0
        correct = reward == 1.0
        if not self.partial_credit:
            reward = float(correct)
        return Score(reward, {"correct": correct, "task": name})
