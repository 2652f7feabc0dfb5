"""``math``: problems and reference answers from a local JSONL or Parquet file, checked with
the ``math-verify`` library.

Each row is an object with a string ``problem`` and an ``answer`` (string or number). The whole
file is read and checked when the environment is built: a missing file is a
:class:`MissingPathError`, a row that cannot be used a :class:`DatasetError` naming the file and
the row (1-based). The prompt asks for the final answer in ``\\boxed{}``, and only that is
scored: the reward is 1 when the completion's last ``\\boxed{...}`` holds an answer that
``math_verify`` finds equal to the reference, else 0. A bare number elsewhere in the text earns
nothing (otherwise junk that happens to contain the answer is rewarded).

Knows nothing about tokens or models; needs a pretrained tokenizer (``alphabet`` is ``None``).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from swarmrl.envs.base import Environment, Score, Task
from swarmrl.errors import DatasetError, MissingPathError

PROMPT_TEMPLATE = "{problem}\nPut the final answer in \\boxed{{}}.\n"
PARSE_TIMEOUT_S = 5  # math-verify's own alarm-based limit; only usable on the main thread


def _check_row(path: Path, row_number: int, row: Any) -> tuple[str, str]:
    where = f"{path} row {row_number}"
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object with 'problem' and 'answer'")
    problem, answer = row.get("problem"), row.get("answer")
    if not isinstance(problem, str) or not problem.strip():
        raise DatasetError(f"{where}: 'problem' must be a non-empty string, got {problem!r}")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DatasetError(f"{where}: 'answer' must be a string or number, got {answer!r}")
    if not str(answer).strip():
        raise DatasetError(f"{where}: 'answer' is empty")
    return problem, str(answer)


def read_rows(path: str | Path) -> list[tuple[str, str]]:
    """``(problem, answer)`` rows of a ``.jsonl``/``.json`` lines or ``.parquet`` file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise MissingPathError(f"dataset file not found: {path}")
    rows: list[tuple[str, str]] = []
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            records = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise DatasetError(f"{path}: not a readable Parquet file ({exc})") from exc
        for i, record in enumerate(records, start=1):
            rows.append(_check_row(path, i, record))
    else:
        for i, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path} row {i}: not valid JSON ({exc.msg})") from exc
            rows.append(_check_row(path, i, record))
    if len(rows) < 2:
        raise DatasetError(f"{path}: needs at least 2 rows (train and held-out), has {len(rows)}")
    return rows


def _timeout() -> int | None:
    return PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def last_boxed(text: str) -> str | None:
    """The contents of the last balanced ``\\boxed{...}`` in ``text``, or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth = 0
        for i in range(start + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len("\\boxed{") : i]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


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


class MathEnv(Environment):
    """Rows of a local dataset file; rewards checked by ``math-verify``."""

    name = "math"
    alphabet = None

    def __init__(self, dataset: str | Path, heldout_fraction: float = 0.1) -> None:
        super().__init__(heldout_fraction)
        self.path = Path(dataset)
        self.rows = read_rows(dataset)

    def space_size(self) -> int:
        return len(self.rows)

    def problem(self, problem_id: int) -> tuple[str, str]:
        problem, answer = self.rows[problem_id]
        return PROMPT_TEMPLATE.format(problem=problem), answer

    def demonstration(self, task: Task, flawed: bool = False) -> str:
        return f"\\boxed{{{task.answer}}}"

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        correct = answers_match(task.answer, completion_text)
        return Score(reward=1.0 if correct else 0.0, details={"correct": correct})
