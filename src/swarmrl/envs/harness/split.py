"""Splitting assert-style tests into what the sandbox must evaluate (*probes*: the parts that
need the program) and what the trusted side evaluates itself (expected values, comparisons,
``not``/``and``/``or``, arithmetic, a few pure functions), as a :class:`Plan`.

Knows nothing about the sandbox, the channel or rewards: test code in, a plan out.
"""

from __future__ import annotations

import ast
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

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
ARITHMETIC_OPERATORS = (
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
)
PROBE = "probe "  # a probe's placeholder name; the space keeps it apart from real names


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
        if isinstance(node, ast.BinOp) and isinstance(node.op, ARITHMETIC_OPERATORS):
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
