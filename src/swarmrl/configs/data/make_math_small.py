"""Write ``math-small.jsonl``: 400 school arithmetic problems with worked solutions.

The rule (deterministic, ``random.Random(0)``): 100 rows of each of four kinds, drawn without
repeats,

- ``sum``:       "What is a + b?"              a, b in 10..99          answer a + b
- ``difference``: "What is a - b?"             a in 10..99, b in 1..a  answer a - b
- ``product``:   "What is a * b?"              a, b in 2..12           answer a * b
- ``equation``:  "Solve for x: x + a = b."     a in 1..50, x in 1..50  answer x (b = x + a)

then shuffled. Each row is ``{"problem", "answer", "solution"}``; the solution is one short
worked line ending in ``\\boxed{answer}``, e.g. ``x = 15 - 7 = 8. \\boxed{8}``. The rows are
made here from the rule above, so the file carries no third-party licence.

Run from the repository root: ``python configs/data/make_math_small.py`` (rewrites the file
next to this script; the output is byte-for-byte the same on every run).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

ROWS_PER_KIND = 100
Row = dict[str, str]


def _sum(rng: random.Random) -> Row:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return _row(f"What is {a} + {b}?", a + b, f"{a} + {b} = {a + b}.")


def _difference(rng: random.Random) -> Row:
    a = rng.randint(10, 99)
    b = rng.randint(1, a)
    return _row(f"What is {a} - {b}?", a - b, f"{a} - {b} = {a - b}.")


def _product(rng: random.Random) -> Row:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return _row(f"What is {a} * {b}?", a * b, f"{a} * {b} = {a * b}.")


def _equation(rng: random.Random) -> Row:
    a, x = rng.randint(1, 50), rng.randint(1, 50)
    b = x + a
    return _row(f"Solve for x: x + {a} = {b}.", x, f"x = {b} - {a} = {x}.")


def _row(problem: str, answer: int, work: str) -> Row:
    return {"problem": problem, "answer": str(answer), "solution": f"{work} \\boxed{{{answer}}}"}


KINDS: tuple[Callable[[random.Random], Row], ...] = (_sum, _difference, _product, _equation)


def make_rows(seed: int = 0) -> list[Row]:
    """The dataset, in file order."""
    rng = random.Random(seed)
    rows: list[Row] = []
    for kind in KINDS:
        seen: set[str] = set()
        while len(seen) < ROWS_PER_KIND:
            row = kind(rng)
            if row["problem"] not in seen:
                seen.add(row["problem"])
                rows.append(row)
    rng.shuffle(rows)
    return rows


def main() -> None:
    out = Path(__file__).with_name("math-small.jsonl")
    out.write_text("".join(json.dumps(row) + "\n" for row in make_rows()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
