"""The trusted side of a harness run: the program the sandbox runs (the runner, the
completion's code and the plan's steps), and the judgement of what came back on the channel —
records read strictly, values decoded into fresh builtin objects, each check evaluated here
with this process's own functions.

Knows nothing about datasets or rewards: a plan and a run's stdout in, an :class:`Outcome` out.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from swarmrl.envs.harness import runner
from swarmrl.envs.harness.runner import MAX_DEPTH
from swarmrl.envs.harness.split import PROBE, Check, Plan

COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
ARITHMETIC: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
RUNNER_SOURCE = Path(runner.__file__).read_text()


class _Forged(Exception):
    """The channel held something other than the harness's next record (raised by
    :func:`read_records`; :func:`judge` turns it into a ``forged`` outcome, never lets it out)."""


@dataclass(frozen=True)
class Outcome:
    """``passed`` of ``tests`` counted tests passed; ``correct`` when every check passed and
    every record arrived; ``channel``: ``complete``, ``incomplete`` (records missing: the
    program left or was stopped early) or ``forged`` (a line that is not the next record)."""

    passed: int
    tests: int
    correct: bool
    channel: Literal["complete", "incomplete", "forged"]


def program(code: str, test_plan: Plan) -> str:
    """The source the sandbox runs: the runner (:mod:`swarmrl.envs.harness.runner`) with the
    program and the steps."""
    steps = [(step.kind, step.source) for step in test_plan.steps]
    return f"{RUNNER_SOURCE}\nmain({code!r}, {steps!r})\n"


def read_records(stdout: str, nonce: str, steps: int) -> tuple[dict[int, tuple[str, Any]], bool]:
    """Step → ("ok", value) or ("error", exception name), for each record that arrived
    (complete lines only: a cut-off last line is a missing record), and whether the end record
    arrived. Raises :class:`_Forged` when a line is not the next record in order."""
    lines = stdout.split("\n")[:-1]
    records: dict[int, tuple[str, Any]] = {}
    ended = False
    prefix = nonce + " "
    for position, line in enumerate(lines):
        if not line.startswith(prefix):
            raise _Forged(f"line {position + 1} does not carry the nonce")
        try:
            record = json.loads(line[len(prefix) :], parse_float=_reject, parse_constant=_reject)
        except (ValueError, RecursionError) as exc:
            raise _Forged(f"line {position + 1} is not JSON: {exc}") from None
        if not isinstance(record, list) or not record:
            raise _Forged(f"line {position + 1} is not a record")
        if position == 0:
            if len(record) != 2 or record[0] != "setup":
                raise _Forged("the first record is not the setup")
            if record[1] is not None:
                if len(lines) > 1:
                    raise _Forged("records after a failed setup")
                return {}, False
        elif position == steps + 1:
            if record != ["end"]:
                raise _Forged("the last record is not the end")
            ended = True
        elif position > steps + 1:
            raise _Forged("records after the end")
        else:
            step = position - 1
            if len(record) != 3 or record[0] != step or type(record[0]) is not int:
                raise _Forged(f"line {position + 1} is not the record of step {step}")
            status, value = record[1], record[2]
            if status == "ok":
                records[step] = ("ok", _decode(value, 0))
            elif status == "error" and type(value) is str:
                records[step] = ("error", value)
            else:
                raise _Forged(f"step {step}: status {str(status)[:20]!r}")
    return records, ended


def _reject(text: str) -> Any:
    raise ValueError(f"untagged float {text[:20]}")


def _decode(value: Any, depth: int) -> Any:
    """A fresh builtin object from an encoded value; :class:`_Forged` if it is not one."""
    kind = type(value)
    if value is None or kind is bool or kind is int:
        return value
    if depth > MAX_DEPTH or kind is not dict or len(value) != 1:
        raise _Forged(f"not an encoded value: {str(value)[:40]!r}")
    ((tag, body),) = value.items()
    try:
        if tag == "f" and type(body) is str:
            return float.fromhex(body)
        if tag == "i" and type(body) is str and len(body) <= 2**18:
            return int(body, 16)
        if tag == "c" and type(body) is list and len(body) == 2:
            return complex(float.fromhex(body[0]), float.fromhex(body[1]))
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "s" and type(body) is str:
            return bytes.fromhex(body).decode("utf-8", "surrogatepass")
        if tag in ("l", "t", "S", "F") and type(body) is list:
            items = [_decode(item, depth + 1) for item in body]
            return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
        if tag == "d" and type(body) is list:
            pairs = [(_decode(k, depth + 1), _decode(v, depth + 1)) for k, v in body]
            return dict(pairs)
    except (ValueError, TypeError, OverflowError) as exc:  # UnicodeError is a ValueError
        raise _Forged(f"not an encoded value: {exc}") from None
    raise _Forged(f"not an encoded value: tag {str(tag)[:10]!r}")


def judge(test_plan: Plan, stdout: str, nonce: str) -> Outcome:
    """The outcome of a run of :func:`program` whose stdout is ``stdout``."""
    total = test_plan.tests
    try:
        records, complete = read_records(stdout, nonce, len(test_plan.steps))
    except _Forged:
        return Outcome(0, total, False, "forged")
    passed, correct = 0, complete
    for check in test_plan.checks:
        ok = _passes(check, records)
        passed += ok and check.counted
        correct = correct and ok
    return Outcome(passed, total, correct, "complete" if complete else "incomplete")


class _Missing(Exception):
    """A probe the check needs has no value (no record, or it raised)."""


def _passes(check: Check, records: dict[int, tuple[str, Any]]) -> bool:
    if check.expr is None:
        return records.get(check.steps[0], ("missing", None))[0] == "ok"
    try:
        return bool(_evaluate(check.expr, records))
    except (_Missing, ArithmeticError, TypeError, ValueError, RecursionError):
        return False


def _evaluate(node: ast.expr, records: dict[int, tuple[str, Any]]) -> Any:
    """Evaluate a planned expression on decoded values, with this process's functions."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        status, value = records.get(int(node.id[len(PROBE) :]), ("missing", None))
        if status != "ok":
            raise _Missing(node.id)
        return value
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, records)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _evaluate(comparator, records)
            if not COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        result: Any = None
        for value_node in node.values:  # short-circuit: a later probe's failure is not needed
            result = _evaluate(value_node, records)
            if bool(result) is isinstance(node.op, ast.Or):
                return result
        return result
    if isinstance(node, ast.UnaryOp):
        operand = _evaluate(node.operand, records)
        if isinstance(node.op, ast.Not):
            return not operand
        return {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}[
            type(node.op)
        ](operand)
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, records), _evaluate(node.right, records)
        _bounded(node, left, right)
        return ARITHMETIC[type(node.op)](left, right)
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        items = [_evaluate(e, records) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        keys = [_evaluate(k, records) for k in node.keys if k is not None]
        return dict(zip(keys, (_evaluate(v, records) for v in node.values), strict=True))
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Constant)
    args = [_evaluate(a, records) for a in node.args]
    kwargs = {k.arg: _evaluate(k.value, records) for k in node.keywords if k.arg is not None}
    return node.func.value(*args, **kwargs)


def _bounded(node: ast.BinOp, left: Any, right: Any) -> None:
    """Refuse arithmetic whose result could be huge: operands may come from the sandbox."""
    op = node.op
    if isinstance(op, ast.Pow) and isinstance(left, int) and isinstance(right, int):
        if abs(right) > 64 and max(left.bit_length(), 1) * abs(right) > 2**20:
            raise ValueError("a power too large to evaluate here")
    if isinstance(op, ast.Mult):
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, str | bytes | list | tuple) and isinstance(times, int):
                if len(seq) * times > 2**20:
                    raise ValueError("a repetition too long to evaluate here")
    if isinstance(op, ast.Mod) and isinstance(left, str | bytes):
        if not isinstance(node.left, ast.Constant):  # `"%0999999999d" % 1` from the sandbox
            raise ValueError("only the tests' own format strings are applied here")
