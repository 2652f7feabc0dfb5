"""The assert harness: scores a program against assert-style tests so that the program under test
cannot decide its own verdict (by leaving early, forging a result or tampering with a
comparison).

The tests are parsed with :mod:`ast` here, in the trusted process. Each top-level ``assert`` is
split into *probes*, the parts that need the program (``add(1, 2)``, ``set(f(x))``), and the
rest, evaluated here: literals (the expected values), comparisons, ``not``, ``and``/``or``,
arithmetic, and a few pure functions (``math.isclose``, ``abs``, ``round``, ``sorted``,
``set``, ...). Only the probes enter the sandbox; expected values never do. There, a small
runner (``swarmrl.envs.harness_runner``) executes the program, then each *step* in order —
evaluate a probe, or execute a test statement that is not an assert (a setup assignment,
``check(candidate)``) — and writes one *record* per step on a channel of its own: a duplicate
of the original stdout, whose fd 1 then points at stderr, so the program's own prints never
reach it. Each record line starts with a nonce drawn per run and given on stdin. Values
travel in a strict encoding that admits exact builtin types only (``None``, ``bool``, ``int``,
``float``, ``complex``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``, ``set``,
``frozenset``); they are decoded here into fresh builtin objects and each assert is
evaluated here with this process's own functions.

A run's outcome is only what its records say; the exit status is ignored. A step without its
record (the program exited, was killed, timed out, or the value outgrew the sandbox's
``output_bytes``) fails; a channel line that is not the next
expected record (forged, duplicated, reordered, undecodable) fails the whole run. A forged
record can at most claim a value the program could have returned honestly, since the program
never sees what the value is compared with.

Not defended: comparisons made inside the sandbox — in a probe that is not split (a
comprehension, ``all(...)``, ``isinstance``), and in test statements that are not top-level
asserts (the asserts inside a ``check`` function) — can be subverted by a program that tampers
with its own process, and values a test block computes there (``expected = ...``) are visible
to it. The hack catalogue in docs/tasks.md lists what is defended and why.

Knows nothing about datasets, rewards or the sandbox's modes: test code and a program in, a
program to run; that run's stdout in, an :class:`Outcome`.
"""

from __future__ import annotations

import ast
import copy
import json
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from swarmrl.envs import harness_runner
from swarmrl.envs.harness_runner import MAX_DEPTH

# Functions the parent evaluates itself, whatever the program binds to these names.
TRUSTED_BUILTINS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (abs, all, any, bool, dict, float, frozenset, int, len, list, max, min, round)
    + (set, sorted, str, sum, tuple)
}
TRUSTED_MATH: dict[str, Callable[..., Any]] = {
    f.__name__: f for f in (math.isclose, math.sqrt, math.floor, math.ceil, math.fabs)
}
MATH_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf, "nan": math.nan}
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
PROBE = "probe "  # a probe's placeholder name; the space keeps it apart from real names
RUNNER_SOURCE = Path(harness_runner.__file__).read_text()


class Forged(Exception):
    """The channel held something other than the harness's next record (raised by
    :func:`read_records`; :func:`judge` turns it into a ``forged`` outcome, never lets it out)."""


@dataclass(frozen=True)
class Step:
    """What the sandbox does for one record: evaluate a probe or execute a statement."""

    kind: Literal["probe", "exec"]
    source: str


@dataclass(frozen=True)
class Check:
    """One top-level test statement. ``expr``: an assert's test with probes replaced by
    ``Name("probe <step>")``, evaluated here; None for a statement that passes when its
    ``steps`` (one) ran without an exception. ``counted``: whether it is a test (an assert or
    an expression statement) rather than setup (an import, a definition, an assignment)."""

    expr: ast.expr | None
    steps: tuple[int, ...]
    counted: bool


@dataclass(frozen=True)
class Plan:
    """The steps the sandbox runs, in order, and one check per top-level test statement."""

    steps: tuple[Step, ...]
    checks: tuple[Check, ...]

    @property
    def tests(self) -> int:
        return sum(check.counted for check in self.checks)


@dataclass(frozen=True)
class Outcome:
    """``passed`` of ``tests`` counted tests passed; ``correct`` when every check passed and
    every record arrived; ``channel``: ``complete``, ``incomplete`` (records missing: the
    program left or was stopped early) or ``forged`` (a line that is not the next record)."""

    passed: int
    tests: int
    correct: bool
    channel: Literal["complete", "incomplete", "forged"]


def plan(tests: str) -> Plan:
    """Split ``tests`` (code that parses) into steps for the sandbox and checks for here.

    A trusted name (``sorted``, ``math.isclose``, ...) always means this process's function,
    even where the program defines one of that name: a program's own ``abs`` or ``isclose``
    must not judge its answers. (A task whose function under test is named like one of them
    gets the builtin in its asserts; such a row needs its function renamed.)

    A HumanEval-style checker — ``def check(candidate):`` whose body is only asserts (and
    imports, docstrings, ``pass``) — is inlined: a top-level ``check(f)`` is replaced by its
    asserts with ``candidate`` bound to ``f``, each split like a top-level assert; and when
    nothing else uses the checker, its definition (with the expected values in it) is not
    sent to the sandbox at all.
    """
    planner = _Planner()
    body = ast.parse(tests).body
    hidden = _checkers_used_only_inlined(body)
    checkers: dict[str, ast.FunctionDef] = {}
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.module == "math" and node.level == 0:
            for alias in node.names:  # `from math import isclose` then `isclose(...)`
                if alias.name in TRUSTED_MATH:
                    planner.math_names[alias.asname or alias.name] = TRUSTED_MATH[alias.name]
        inlined = _inline(node, checkers)
        if inlined is None:  # a checker only ever inlined never enters the sandbox
            inlined = [] if node in hidden else [node]
        for statement in inlined:
            planner.statement(statement)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            checkers.pop(node.name, None)
            if isinstance(node, ast.FunctionDef) and _asserts_only(node):
                checkers[node.name] = node
    return Plan(tuple(planner.steps), tuple(planner.checks))


def _checkers_used_only_inlined(body: list[ast.stmt]) -> list[ast.stmt]:
    """The checker definitions in ``body`` that nothing uses but calls that are inlined, so
    the sandbox needs neither the definition nor the expected values in it."""
    hidden = []
    for position, node in enumerate(body):
        if not (isinstance(node, ast.FunctionDef) and _asserts_only(node)):
            continue
        later = body[position + 1 :]
        defined_again = any(
            isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and n.name == node.name
            for n in later
        )
        uses = sum(
            isinstance(n, ast.Name) and n.id == node.name
            for n in ast.walk(ast.Module(body=[*body[:position], *later], type_ignores=[]))
        )
        calls = sum(_inline(n, {node.name: node}) is not None for n in later)
        if not defined_again and uses == calls:
            hidden.append(node)
    return hidden


def _asserts_only(function: ast.FunctionDef) -> bool:
    """Whether ``function`` takes one plain parameter, never rebinds it, and only asserts."""
    args = function.args
    if function.decorator_list or len(args.args) != 1 or args.defaults or args.vararg:
        return False
    if args.posonlyargs or args.kwonlyargs or args.kwarg:
        return False
    param = args.args[0].arg
    allowed = (ast.Assert, ast.Import, ast.ImportFrom, ast.Pass)
    for statement in function.body:
        docstring = isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
        if not (isinstance(statement, allowed) or docstring):
            return False
    for inner in ast.walk(ast.Module(body=function.body, type_ignores=[])):
        if isinstance(inner, ast.arg) and inner.arg == param:
            return False  # a lambda's own parameter of that name
        if (
            isinstance(inner, ast.Name)
            and inner.id == param
            and not isinstance(inner.ctx, ast.Load)
        ):
            return False
        if isinstance(inner, ast.alias) and (inner.asname or inner.name) == param:
            return False
    return any(isinstance(statement, ast.Assert) for statement in function.body)


def _inline(node: ast.stmt, checkers: dict[str, ast.FunctionDef]) -> list[ast.stmt] | None:
    """The statements of checker call ``node`` (``check(f)``) with the parameter bound to
    the argument, or None when ``node`` is not such a call."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return None
    call = node.value
    if not isinstance(call.func, ast.Name) or call.func.id not in checkers or call.keywords:
        return None
    if len(call.args) != 1 or isinstance(call.args[0], ast.Starred):
        return None
    function = checkers[call.func.id]
    param, argument = function.args.args[0].arg, call.args[0]

    class Bind(ast.NodeTransformer):
        def visit_Name(self, name: ast.Name) -> ast.expr:
            return copy.deepcopy(argument) if name.id == param else name

    statements = []
    for statement in function.body:
        if isinstance(statement, ast.Assert | ast.Import | ast.ImportFrom):
            statements.append(Bind().visit(copy.deepcopy(statement)))
    return statements


class _Planner:
    def __init__(self) -> None:
        self.math_names: dict[str, Callable[..., Any]] = {}
        self.steps: list[Step] = []
        self.checks: list[Check] = []

    def statement(self, node: ast.stmt) -> None:
        """A top-level test statement: an assert is split, anything else runs as it is."""
        if isinstance(node, ast.Assert):
            first = len(self.steps)
            expr = self.split(node.test)
            self.checks.append(Check(expr, tuple(range(first, len(self.steps))), True))
        else:
            self.steps.append(Step("exec", ast.unparse(node)))
            counted = isinstance(node, ast.Expr)
            self.checks.append(Check(None, (len(self.steps) - 1,), counted))

    def function(self, node: ast.expr) -> Callable[..., Any] | None:
        """The trusted function ``node`` names, if it names one."""
        if isinstance(node, ast.Name):
            return TRUSTED_BUILTINS.get(node.id) or self.math_names.get(node.id)
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "math"
        ):
            return TRUSTED_MATH.get(node.attr)
        return None

    def constant(self, node: ast.expr) -> tuple[bool, Any]:
        """(True, value) for test data: a literal, a math constant or a trusted function."""
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "math"
            and node.attr in MATH_CONSTANTS
        ):
            return True, MATH_CONSTANTS[node.attr]
        function = self.function(node)
        if function is not None:  # a trusted function as a value: `sorted(..., key=len)`
            return True, function
        if isinstance(node, ast.Name):
            return False, None  # literal_eval would not read it either; skip the exception
        try:
            return True, ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False, None

    def parts(self, node: ast.expr) -> list[ast.expr] | None:
        """The operands of a node this process can evaluate itself, else None."""
        if isinstance(node, ast.Compare):
            if any(isinstance(op, ast.Is | ast.IsNot) for op in node.ops) and not (
                len(node.ops) == 1
                and isinstance(node.comparators[0], ast.Constant)
                and node.comparators[0].value in (None, True, False)
            ):
                return None  # identity of two decoded values means nothing: the sandbox does it
            return [node.left, *node.comparators]
        if isinstance(node, ast.BoolOp):
            return list(node.values)
        if isinstance(node, ast.UnaryOp):
            return [node.operand]
        if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
            return [node.left, node.right]
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            elts = node.elts
            return None if any(isinstance(e, ast.Starred) for e in elts) else list(elts)
        if isinstance(node, ast.Dict):
            if any(key is None for key in node.keys):  # `{**other}`
                return None
            return [*(k for k in node.keys if k is not None), *node.values]
        if isinstance(node, ast.Call) and self.function(node.func) is not None:
            if any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords
            ):
                return None
            return [*node.args, *(k.value for k in node.keywords)]
        return None

    def here(self, node: ast.expr) -> bool:
        """Whether ``node`` is evaluated here rather than sent whole to the sandbox: it is
        test data, ``not``/``and``/``or`` (truth is taken of decoded values), or an evaluable
        node with some operand evaluated here. A comparison between values of the program
        alone (``Point(1, 2) == Point(1, 2)``) involves no expected value and judges the
        program's own ``__eq__``: the sandbox makes it."""
        if isinstance(node, ast.BoolOp) or (
            isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)
        ):
            return True
        if self.constant(node)[0]:
            return True
        operands = self.parts(node)
        return operands is not None and (not operands or any(self.here(o) for o in operands))

    def split(self, node: ast.expr) -> ast.expr:
        """``node`` with each probe replaced by its placeholder (steps appended in order)."""
        known, value = self.constant(node)
        if known:
            return ast.Constant(value=value)
        if not self.here(node):
            self.steps.append(Step("probe", ast.unparse(node)))
            return ast.Name(id=f"{PROBE}{len(self.steps) - 1}", ctx=ast.Load())
        if isinstance(node, ast.Compare):
            left, *comparators = (self.split(p) for p in [node.left, *node.comparators])
            return ast.Compare(left=left, ops=node.ops, comparators=comparators)
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(op=node.op, values=[self.split(v) for v in node.values])
        if isinstance(node, ast.UnaryOp):
            return ast.UnaryOp(op=node.op, operand=self.split(node.operand))
        if isinstance(node, ast.BinOp):
            return ast.BinOp(left=self.split(node.left), op=node.op, right=self.split(node.right))
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            return type(node)(elts=[self.split(e) for e in node.elts], ctx=ast.Load())
        if isinstance(node, ast.Dict):
            keys = [self.split(k) for k in node.keys if k is not None]
            return ast.Dict(keys=keys, values=[self.split(v) for v in node.values])
        assert isinstance(node, ast.Call)
        call = ast.Call(
            func=ast.Constant(value=self.function(node.func)),
            args=[self.split(a) for a in node.args],
            keywords=[ast.keyword(arg=k.arg, value=self.split(k.value)) for k in node.keywords],
        )
        return call


def program(code: str, test_plan: Plan) -> str:
    """The source the sandbox runs: the runner (``harness_runner``) with the program and the
    steps."""
    steps = [(step.kind, step.source) for step in test_plan.steps]
    return f"{RUNNER_SOURCE}\nmain({code!r}, {steps!r})\n"


def read_records(stdout: str, nonce: str, steps: int) -> tuple[dict[int, tuple[str, Any]], bool]:
    """Step → ("ok", value) or ("error", exception name), for each record that arrived
    (complete lines only: a cut-off last line is a missing record), and whether the end record
    arrived. Raises :class:`Forged` when a line is not the next record in order."""
    lines = stdout.split("\n")[:-1]
    records: dict[int, tuple[str, Any]] = {}
    ended = False
    prefix = nonce + " "
    for position, line in enumerate(lines):
        if not line.startswith(prefix):
            raise Forged(f"line {position + 1} does not carry the nonce")
        try:
            record = json.loads(line[len(prefix) :], parse_float=_reject, parse_constant=_reject)
        except (ValueError, RecursionError) as exc:
            raise Forged(f"line {position + 1} is not JSON: {exc}") from None
        if not isinstance(record, list) or not record:
            raise Forged(f"line {position + 1} is not a record")
        if position == 0:
            if len(record) != 2 or record[0] != "setup":
                raise Forged("the first record is not the setup")
            if record[1] is not None:
                if len(lines) > 1:
                    raise Forged("records after a failed setup")
                return {}, False
        elif position == steps + 1:
            if record != ["end"]:
                raise Forged("the last record is not the end")
            ended = True
        elif position > steps + 1:
            raise Forged("records after the end")
        else:
            step = position - 1
            if len(record) != 3 or record[0] != step or type(record[0]) is not int:
                raise Forged(f"line {position + 1} is not the record of step {step}")
            status, value = record[1], record[2]
            if status == "ok":
                records[step] = ("ok", _decode(value, 0))
            elif status == "error" and type(value) is str:
                records[step] = ("error", value)
            else:
                raise Forged(f"step {step}: status {str(status)[:20]!r}")
    return records, ended


def _reject(text: str) -> Any:
    raise ValueError(f"untagged float {text[:20]}")


def _decode(value: Any, depth: int) -> Any:
    """A fresh builtin object from an encoded value; :class:`Forged` if it is not one."""
    kind = type(value)
    if value is None or kind is bool or kind is int:
        return value
    if depth > MAX_DEPTH or kind is not dict or len(value) != 1:
        raise Forged(f"not an encoded value: {str(value)[:40]!r}")
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
        raise Forged(f"not an encoded value: {exc}") from None
    raise Forged(f"not an encoded value: tag {str(tag)[:10]!r}")


def judge(test_plan: Plan, stdout: str, nonce: str) -> Outcome:
    """The outcome of a run of :func:`program` whose stdout is ``stdout``."""
    total = test_plan.tests
    try:
        records, complete = read_records(stdout, nonce, len(test_plan.steps))
    except Forged:
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
