"""Training on a filtered subset of an environment, and the file that names it.

``swarmrl filter`` writes one JSON object per kept task: ``problem_id`` (the task's id in its
environment), ``prompt``, ``answer``, ``pass_rate``, and for dataset-backed environments the
task's original dataset row (same columns), so the file is also a dataset that environment reads
as is. :class:`SubsetEnv` reads it back for *any* environment: its training split is the listed
problem ids, in file order; its held-out split is the inner environment's, unchanged, so
evaluation stays comparable with the unfiltered run.

A listed id outside the environment, or one that lies in its held-out split (the file was made
for a different environment or config), is a :class:`DatasetError` naming the row.

Knows nothing about tokens, models or how the pass rates were measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from swarmrl.envs.base import Environment, Score, Split, Task
from swarmrl.errors import DatasetError, MissingPathError


def read_problem_ids(path: str | Path) -> list[int]:
    """The ``problem_id`` of every row of a filter output file, in order."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise MissingPathError(f"training subset file not found: {path}")
    ids: list[int] = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path} row {i}: not valid JSON ({exc.msg})") from exc
        pid = row.get("problem_id") if isinstance(row, dict) else None
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise DatasetError(f"{path} row {i}: needs an integer 'problem_id', got {pid!r}")
        ids.append(pid)
    if not ids:
        raise DatasetError(f"{path}: no tasks (the filter kept none?)")
    return ids


class SubsetEnv(Environment):
    """``inner`` trained only on ``problem_ids`` (all from its training split)."""

    def __init__(self, inner: Environment, problem_ids: list[int], source: str = "") -> None:
        super().__init__(inner.heldout_fraction)
        self.inner = inner
        self.name = inner.name
        self.alphabet = inner.alphabet
        self.prose = inner.prose
        self.system_prompt = inner.system_prompt
        n = inner.space_size()
        for row, pid in enumerate(problem_ids, start=1):
            if not 0 <= pid < n:
                raise DatasetError(f"{source} row {row}: problem_id {pid} outside 0..{n - 1}")
            if inner.task_for_id(pid).split != "train":
                raise DatasetError(f"{source} row {row}: problem_id {pid} is a held-out task")
        self.ids = list(dict.fromkeys(problem_ids))
        self._positions = {pid: i for i, pid in enumerate(self.ids)}

    def space_size(self) -> int:
        return self.inner.space_size()

    def problem(self, problem_id: int) -> tuple[str, str]:
        return self.inner.problem(problem_id)

    def record(self, problem_id: int) -> dict[str, Any]:
        return self.inner.record(problem_id)

    def split_size(self, split: Split) -> int:
        return len(self.ids) if split == "train" else self.inner.split_size("heldout")

    def problem_id(self, split: Split, index: int) -> int:
        if split == "heldout":
            return self.inner.problem_id(split, index)
        if not 0 <= index < len(self.ids):
            raise IndexError(f"{self.name}: train index {index} outside 0..{len(self.ids) - 1}")
        return self.ids[index]

    def task(self, split: Split, index: int) -> Task:
        inner = self.inner.task_for_id(self.problem_id(split, index))
        return Task(
            problem_id=inner.problem_id,
            split=split,
            index=index,
            prompt=inner.prompt,
            answer=inner.answer,
            meta=inner.meta,
            system=inner.system,
        )

    def task_for_id(self, problem_id: int) -> Task:
        if problem_id in self._positions:
            return self.task("train", self._positions[problem_id])
        return self.inner.task_for_id(problem_id)

    def demonstration(self, task: Task, flawed: bool = False) -> str:
        return self.inner.demonstration(task, flawed)

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        return self.inner.score(task, completion_text, num_tokens)
