"""``code`` and ``code_tiny``: programming tasks scored by running the completion's code in the
sandbox (``swarmrl.envs.sandbox``), on the trusted side only (validator and trainer score;
workers never run code).

``code`` reads problems with tests from a dataset (``swarmrl.envs.data``): the problem text in
``env.problem_column`` and the tests in ``env.tests_column``, in one of the common forms:

- stdin/stdout cases: ``{"inputs": [...], "outputs": [...]}``, as an object or as JSON text
  (APPS' ``input_output``, CodeContests-style sets). The program reads the input on stdin; a
  case passes when its stdout equals the expected output up to trailing whitespace per line.
  Reward = share of cases passed.
- assert-style: a list of ``assert`` statements (MBPP's ``test_list``) or one block of test
  code, scored through the assert harness (``swarmrl.envs.harness``): each assert is split
  into what needs the program (evaluated in the sandbox, its value sent back over a channel
  of records) and the comparison with the expected value (done here; expected values never
  enter the sandbox). Reward = 1 when every test passed and every record arrived; the
  program's exit status plays no part.

The completion's code is its last fenced block (a python block preferred), else the whole text.
A row whose tests are in neither form is a :class:`DatasetError` naming the row.

``code_tiny`` is the learnable one, for the demo-size model: the prompt states a line
``y=3x-17;`` and the completion is a Python expression in ``x`` (``3*x-17``) that the sandbox
evaluates for eight hidden inputs; reward = share of outputs right. The warm start's
characteristic mistake is the mathematician's implicit product (``3x-17``), not valid Python,
so it earns nothing until RL teaches the model to write the ``*``.

Knows nothing about tokens or models.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmrl.envs import harness
from swarmrl.envs.base import Environment, Score, Task
from swarmrl.envs.data import column_text, load_records
from swarmrl.envs.sandbox import RunResult, Sandbox
from swarmrl.errors import DatasetError

PROMPT_TEMPLATE = (
    "{problem}\n\nWrite a complete Python 3 program. Put it in one ```python code block.\n"
)
FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


@dataclass(frozen=True)
class Tests:
    """Stdin/stdout ``cases`` (input, expected output), or ``asserts`` code; one is set."""

    cases: tuple[tuple[str, str], ...] = ()
    asserts: str = ""


def extract_code(completion: str) -> str:
    """The last ```python block of ``completion``, else its last fenced block, else all of it."""
    blocks = FENCE.findall(completion)
    python = [code for lang, code in blocks if lang.lower() in ("python", "python3", "py")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return completion


def same_output(actual: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""

    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip("\n").splitlines()]

    return norm(actual) == norm(expected)


def parse_tests(value: Any, where: str) -> Tests:
    """The tests of one row (see the module docstring), or a :class:`DatasetError`."""
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict):
            value = decoded
        elif value.strip():
            return Tests(asserts=_test_code(value, where))
    if isinstance(value, dict):
        inputs, outputs = value.get("inputs"), value.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
            raise DatasetError(f"{where}: tests need non-empty 'inputs' and 'outputs' lists")
        if len(inputs) != len(outputs):
            raise DatasetError(f"{where}: {len(inputs)} inputs but {len(outputs)} outputs")
        return Tests(
            cases=tuple((_text(i), _text(o)) for i, o in zip(inputs, outputs, strict=True))
        )
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return Tests(asserts=_test_code("\n".join(value), where))
    raise DatasetError(
        f"{where}: tests must be {{'inputs','outputs'}} cases or assert statements, got "
        f"{str(value)[:60]!r}"
    )


def _test_code(code: str, where: str) -> str:
    """``code`` when the harness can split it (it parses as Python and holds at least one
    assert or test call), else a :class:`DatasetError`."""
    try:
        tests = harness.plan(code).tests
    except (SyntaxError, ValueError, RecursionError) as exc:
        raise DatasetError(f"{where}: the test code is not valid Python 3: {exc}") from None
    if tests == 0:
        raise DatasetError(f"{where}: the test code has no assert and no test call")
    return code


def _text(value: Any) -> str:
    if isinstance(value, list):  # some sets store a case as a list of lines
        return "\n".join(str(v) for v in value)
    return str(value)


def run_tests(sandbox: Sandbox, code: str, tests: Tests) -> Score:
    """Score ``code`` against ``tests``: share of cases passed (or 1/0 for asserts)."""
    if tests.asserts:
        return run_asserts(sandbox, code, tests.asserts)
    passed, last = 0, None
    for stdin, expected in tests.cases:
        last = sandbox.run(code, stdin)
        if last.verdict == "ok" and same_output(last.stdout, expected):
            passed += 1
        elif last.verdict == "timeout":
            break  # the rest would most likely time out too; they count as failed
    assert last is not None
    return _score(passed, len(tests.cases), last)


def run_asserts(sandbox: Sandbox, code: str, test_code: str) -> Score:
    """Score ``code`` against assert-style ``test_code`` through the harness: 1 when every test
    passed and every record arrived, else 0; ``details["channel"]`` says whether the records
    were complete, cut short, or forged."""
    plan = harness.plan(test_code)
    nonce = secrets.token_hex(16)
    result = sandbox.run(harness.program(code, plan), nonce + "\n")
    outcome = harness.judge(plan, result.stdout, nonce)
    details = {
        "correct": outcome.correct,
        "passed": outcome.passed,
        "tests": outcome.tests,
        "verdict": result.verdict,
        "channel": outcome.channel,
    }
    return Score(reward=float(outcome.correct), details=details)


def _score(passed: int, total: int, last: RunResult) -> Score:
    return Score(
        reward=passed / total,
        details={
            "correct": passed == total,
            "passed": passed,
            "tests": total,
            "verdict": last.verdict,
        },
    )


class CodeEnv(Environment):
    """Problems with tests from a dataset; completions run in ``sandbox``."""

    name = "code"
    alphabet = None

    def __init__(
        self,
        dataset: str | Path,
        sandbox: Sandbox,
        heldout_fraction: float = 0.1,
        problem_column: str = "problem",
        tests_column: str = "tests",
        split: str = "train",
        config_name: str | None = None,
    ) -> None:
        super().__init__(heldout_fraction)
        self.sandbox = sandbox
        self.records = load_records(dataset, split, config_name)
        self.rows: list[tuple[str, Tests]] = []
        for i, row in enumerate(self.records):
            problem = column_text(dataset, self.records, i, problem_column, "env.problem_column")
            if tests_column not in row:
                columns = ", ".join(sorted(row))
                raise DatasetError(
                    f"{dataset} row {i + 1}: no column '{tests_column}' (has {columns}; "
                    "set env.tests_column)"
                )
            self.rows.append((problem, parse_tests(row[tests_column], f"{dataset} row {i + 1}")))
        if len(self.rows) < 2:
            raise DatasetError(f"{dataset}: needs at least 2 rows, has {len(self.rows)}")

    def space_size(self) -> int:
        return len(self.rows)

    def problem(self, problem_id: int) -> tuple[str, str]:
        problem, tests = self.rows[problem_id]
        shown = tests.asserts or json.dumps([list(c) for c in tests.cases])
        return PROMPT_TEMPLATE.format(problem=problem), shown

    def record(self, problem_id: int) -> dict[str, Any]:
        return self.records[problem_id]

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        return run_tests(self.sandbox, extract_code(completion_text), self.rows[task.problem_id][1])


TINY_INPUTS = (0, 1, 2, 5, 7, -3, 11, 40)
TINY_PROGRAM = "import sys\nfor line in sys.stdin:\n    x = int(line)\n    print({expr})\n"


class CodeTinyEnv(Environment):
    """``y=ax±b;`` → the Python expression ``a*x±b``, run on hidden inputs in the sandbox."""

    name = "code_tiny"
    alphabet = "0123456789x*+-=y;"

    def __init__(self, sandbox: Sandbox, heldout_fraction: float = 0.1) -> None:
        super().__init__(heldout_fraction)
        self.sandbox = sandbox

    def space_size(self) -> int:
        return 8 * 100 * 2  # a in 2..9, b in 0..99, sign +/-

    def coefficients(self, problem_id: int) -> tuple[int, int, str]:
        rest, sign = divmod(problem_id, 2)
        a, b = divmod(rest, 100)
        return a + 2, b, "+-"[sign]

    def problem(self, problem_id: int) -> tuple[str, str]:
        a, b, sign = self.coefficients(problem_id)
        return f"y={a}x{sign}{b};", f"{a}*x{sign}{b}"

    def demonstration(self, task: Task, flawed: bool = False) -> str:
        return task.answer.replace("*", "") if flawed else task.answer

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        expr = completion_text.strip()
        if not expr or "\n" in expr:
            return Score(0.0, {"correct": False, "passed": 0, "tests": len(TINY_INPUTS)})
        a, b, sign = self.coefficients(task.problem_id)
        expected = "\n".join(str(a * x + (b if sign == "+" else -b)) for x in TINY_INPUTS)
        result = self.sandbox.run(
            TINY_PROGRAM.format(expr=expr), "\n".join(map(str, TINY_INPUTS)) + "\n"
        )
        got = result.stdout.splitlines() if result.verdict == "ok" else []
        passed = sum(g.strip() == e for g, e in zip(got, expected.splitlines(), strict=False))
        return _score(passed, len(TINY_INPUTS), result)
