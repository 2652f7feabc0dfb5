"""``math``: problems and reference answers from a dataset, checked with the ``math-verify``
library.

The dataset is a file, a local directory or a hub id read through ``datasets`` (see
``swarmrl.envs.data``). Each row has a problem column and an answer column (``env.problem_column``,
``env.answer_column``; ``problem``/``answer`` by default, ``question``/``answer`` for GSM8K,
``problem``/``solution`` for MATH). The reference answer is taken out of the answer text by
``env.answer_format``: GSM8K's ``#### 42``, the last ``\\boxed{}``, or the plain text. Every row
is read and checked when the environment is built: a missing file is a
:class:`MissingPathError`, a row that cannot be used a :class:`DatasetError` naming the source and
the row (1-based). The prompt asks for the final answer in ``\\boxed{}``, and only that is
scored: the reward is 1 when the completion's last ``\\boxed{...}`` holds an answer that
``math_verify`` finds equal to the reference, else 0. A bare number elsewhere in the text earns
nothing (otherwise junk that happens to contain the answer is rewarded).

The warm-start demonstration is the row's worked solution (``env.solution_column``, which must
end in the reference answer's ``\\boxed{}``), or the boxed answer alone. ``alphabet`` is every
character of the prompts and demonstrations, so the built-in character tokenizer covers the
dataset and a tiny model can be trained on it from scratch (``model.path`` unset).

Knows nothing about tokens or models.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from swarmrl.envs.base import Environment, Score, Task
from swarmrl.envs.data import AnswerFormat, column_text, last_boxed, load_records, reference_answer
from swarmrl.errors import DatasetError

__all__ = ["MathEnv", "answers_match", "last_boxed", "read_rows"]

PROMPT_TEMPLATE = "{problem}\nPut the final answer in \\boxed{{}}.\n"
PARSE_TIMEOUT_S = 5  # math-verify's own alarm-based limit; only usable on the main thread


def dataset_alphabet(texts: list[str]) -> str:
    """Every distinct character of ``texts``, in code-point order."""
    return "".join(sorted(set("".join(texts))))


def read_rows(
    source: str | Path,
    problem_column: str = "problem",
    answer_column: str = "answer",
    answer_format: AnswerFormat = "auto",
    split: str = "train",
    config_name: str | None = None,
) -> list[tuple[str, str]]:
    """``(problem, reference answer)`` of every row of ``source`` (see ``swarmrl.envs.data``)."""
    return checked_rows(
        source,
        load_records(source, split, config_name),
        problem_column,
        answer_column,
        answer_format,
    )


def checked_rows(
    source: str | Path,
    records: list[dict[str, Any]],
    problem_column: str,
    answer_column: str,
    answer_format: AnswerFormat,
) -> list[tuple[str, str]]:
    """``(problem, reference answer)`` of every record, or an error naming the first bad row."""
    rows: list[tuple[str, str]] = []
    for i in range(len(records)):
        problem = column_text(source, records, i, problem_column, "env.problem_column", False)
        answer_text = column_text(source, records, i, answer_column, "env.answer_column")
        answer = reference_answer(answer_text, answer_format)
        if answer is None:
            raise DatasetError(
                f"{source} row {i + 1}: no {answer_format} answer in '{answer_column}' "
                f"({answer_text[:60]!r}); set env.answer_format"
            )
        rows.append((problem, answer))
    if len(rows) < 2:
        raise DatasetError(f"{source}: needs at least 2 rows (train and held-out), has {len(rows)}")
    return rows


def _timeout() -> int | None:
    return PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def answers_match(reference: str, completion: str) -> bool:
    """Whether the final boxed answer of ``completion`` equals ``reference`` (``math_verify``)."""
    from math_verify import parse, verify

    boxed = last_boxed(completion)
    if boxed is None or not boxed.strip():
        return False
    gold = parse(f"${reference}$", parsing_timeout=_timeout())
    if not gold:
        gold = parse(reference, parsing_timeout=_timeout())
    predicted = parse(f"$\\boxed{{{boxed}}}$", parsing_timeout=_timeout())
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=_timeout()))


def checked_solutions(
    source: str | Path,
    records: list[dict[str, Any]],
    rows: list[tuple[str, str]],
    solution_column: str,
) -> list[str]:
    """Each record's worked solution, or an error naming the first one whose final
    ``\\boxed{}`` is missing or differs from the row's reference answer."""
    solutions: list[str] = []
    for i, (_, answer) in enumerate(rows):
        text = column_text(source, records, i, solution_column, "env.solution_column")
        if (last_boxed(text) or "").strip() != answer.strip():
            raise DatasetError(
                f"{source} row {i + 1}: the solution in '{solution_column}' does not end in "
                f"\\boxed{{{answer}}} ({text[-60:]!r})"
            )
        solutions.append(text)
    return solutions


class MathEnv(Environment):
    """Rows of a local dataset file; rewards checked by ``math-verify``."""

    name = "math"
    prose = True

    def __init__(
        self,
        dataset: str | Path,
        heldout_fraction: float = 0.1,
        problem_column: str = "problem",
        answer_column: str = "answer",
        answer_format: AnswerFormat = "auto",
        split: str = "train",
        config_name: str | None = None,
        solution_column: str | None = None,
    ) -> None:
        super().__init__(heldout_fraction)
        self.path = Path(dataset)
        self.records = load_records(dataset, split, config_name)
        self.rows = checked_rows(
            dataset, self.records, problem_column, answer_column, answer_format
        )
        self.solutions = (
            None
            if solution_column is None
            else checked_solutions(dataset, self.records, self.rows, solution_column)
        )
        shown = [self.problem(i)[0] for i in range(len(self.rows))]
        shown += [self._demonstration(i) for i in range(len(self.rows))]
        self.alphabet: str | None = dataset_alphabet(shown)

    def record(self, problem_id: int) -> dict[str, Any]:
        """Problem ``problem_id``'s dataset row, as read (same columns, so it reads back)."""
        return self.records[problem_id]

    def space_size(self) -> int:
        return len(self.rows)

    def problem(self, problem_id: int) -> tuple[str, str]:
        problem, answer = self.rows[problem_id]
        return PROMPT_TEMPLATE.format(problem=problem), answer

    def demonstration(self, task: Task, flawed: bool = False) -> str:
        return self._demonstration(task.problem_id)

    def _demonstration(self, problem_id: int) -> str:
        if self.solutions is not None:
            return self.solutions[problem_id]
        return f"\\boxed{{{self.rows[problem_id][1]}}}"

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        correct = answers_match(task.answer, completion_text)
        return Score(reward=1.0 if correct else 0.0, details={"correct": correct})
