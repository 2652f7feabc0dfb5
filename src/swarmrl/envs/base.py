"""The environment interface: deterministic tasks, a disjoint train/held-out split, scoring.

An environment is a finite problem space ``0 .. space_size-1`` plus three verbs: build the
problem with a given id, format its prompt, and score a completion. The split is generic: a
fixed bijective permutation of the space (``perm(i) = (a·i + c) mod N`` with ``gcd(a, N) = 1``)
whose first ``heldout`` positions are the held-out split and the rest the training split, so the
two splits can never share a problem, and ``task(split, index)`` is a pure function of its
arguments. Sampling by seed draws indices from ``random.Random(seed)``.

Knows nothing about tokenizers, models or training: prompts and completions are plain text.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")


@dataclass(frozen=True)
class Task:
    """One problem of an environment.

    ``problem_id`` is the position in the whole problem space (unique across splits), ``index``
    the position within ``split``. ``prompt`` is the formatted text the policy sees (the user
    turn when the tokenizer has a chat template). ``answer`` is the reference answer as the task
    states it; ``meta`` carries per-task extras a wrapper adds (e.g. a length target).
    ``system`` is the system prompt a chat template puts before the prompt (``None``: none).
    """

    problem_id: int
    split: Split
    index: int
    prompt: str
    answer: str
    meta: dict[str, int | float | str] = field(default_factory=dict)
    system: str | None = None


@dataclass(frozen=True)
class Score:
    """The reward of one completion, in [0, 1], and what it was made of."""

    reward: float
    details: dict[str, float | int | str | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (0.0 <= self.reward <= 1.0) or math.isnan(self.reward):
            raise ValueError(f"reward must lie in [0, 1], got {self.reward}")


def _multiplier(n: int, salt: int) -> int:
    """A multiplier coprime to ``n`` near the golden-ratio fraction of ``n`` (scrambles order)."""
    if n <= 2:
        return 1
    a = (int(n * 0.6180339887) + salt) % n or 1
    while math.gcd(a, n) != 1:
        a = a % (n - 1) + 1
    return a


class Environment(ABC):
    """A verifiable task with a deterministic, disjoint train/held-out split.

    Subclasses set ``name`` and implement :meth:`space_size`, :meth:`problem` and
    :meth:`score`; they may override :meth:`demonstration` (worked example for the warm start)
    and :attr:`alphabet` (the characters a char tokenizer needs; ``None`` means the task needs a
    pretrained tokenizer).
    """

    name: str = "env"
    alphabet: str | None = None
    # prompts are prose (a dataset's text), so instructions added to them are written out in
    # words; built-in symbol tasks (False) get compact ones made of few characters
    prose: bool = False
    system_prompt: str | None = None  # set from ``env.system_prompt`` by ``build_env``

    def __init__(self, heldout_fraction: float = 0.1, split_salt: int = 0) -> None:
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must lie in (0, 1), got {heldout_fraction}")
        self.heldout_fraction = heldout_fraction
        self._salt = split_salt

    # --- what a subclass defines ---------------------------------------------------------------
    @abstractmethod
    def space_size(self) -> int:
        """Number of distinct problems."""

    @abstractmethod
    def problem(self, problem_id: int) -> tuple[str, str]:
        """``(prompt, answer)`` of problem ``problem_id``."""

    @abstractmethod
    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        """Reward of ``completion_text`` (special tokens already stripped) for ``task``."""

    def demonstration(self, task: Task, flawed: bool = False) -> str:
        """The completion a warm-start example teaches; ``flawed`` asks for the task's
        characteristic mistake (environments without one return the correct answer)."""
        return task.answer

    def record(self, problem_id: int) -> dict[str, Any]:
        """Problem ``problem_id`` as a data row: the dataset row for dataset-backed
        environments (so it reads back), else ``{"problem", "answer"}``."""
        prompt, answer = self.problem(problem_id)
        return {"problem": prompt, "answer": answer}

    # --- the split, shared by every environment ------------------------------------------------
    def split_size(self, split: Split) -> int:
        n = self.space_size()
        heldout = max(1, min(n - 1, round(n * self.heldout_fraction)))
        return heldout if split == "heldout" else n - heldout

    def problem_id(self, split: Split, index: int) -> int:
        """Position in the problem space of the ``index``-th problem of ``split``."""
        size = self.split_size(split)
        if not 0 <= index < size:
            raise IndexError(f"{self.name}: {split} index {index} outside 0..{size - 1}")
        n = self.space_size()
        offset = 0 if split == "heldout" else self.split_size("heldout")
        a = _multiplier(n, self._salt)
        return (a * (offset + index) + self._salt * 7919) % n

    def task(self, split: Split, index: int) -> Task:
        pid = self.problem_id(split, index)
        prompt, answer = self.problem(pid)
        return Task(
            problem_id=pid,
            split=split,
            index=index,
            prompt=prompt,
            answer=answer,
            system=self.system_prompt,
        )

    def task_for_id(self, problem_id: int) -> Task:
        """The task of a problem id, located in whichever split holds it."""
        n = self.space_size()
        a = _multiplier(n, self._salt)
        position = ((problem_id - self._salt * 7919) * pow(a, -1, n)) % n if n > 1 else 0
        heldout = self.split_size("heldout")
        if position < heldout:
            return self.task("heldout", position)
        return self.task("train", position - heldout)

    def sample(self, split: Split, n: int, seed: int) -> list[Task]:
        """``n`` tasks of ``split`` drawn with replacement by ``random.Random(seed)``."""
        rng = random.Random(seed)
        size = self.split_size(split)
        return [self.task(split, rng.randrange(size)) for _ in range(n)]

    def first(self, split: Split, n: int) -> list[Task]:
        """The first ``n`` distinct tasks of ``split`` (the fixed evaluation set)."""
        return [self.task(split, i) for i in range(min(n, self.split_size(split)))]
