"""The assert harness: scores a program against assert-style tests so that the program under test
cannot decide its own verdict (by leaving early, forging a result or tampering with a
comparison).

The tests are parsed with :mod:`ast` here, in the trusted process. Each top-level ``assert`` (and
each assert of a HumanEval-style ``check(candidate)`` that is only asserts) is split into
*probes*, the parts that need the program (``add(1, 2)``, ``set(f(x))``), and the
rest, evaluated here: literals (the expected values), comparisons, ``not``, ``and``/``or``,
arithmetic, and a few pure functions (``math.isclose``, ``abs``, ``round``, ``sorted``,
``set``, ...). Only the probes enter the sandbox; expected values never do. There, a small
runner (``swarmrl.envs.harness.runner``) executes the program, then each *step* in order —
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
``output_bytes``) fails; a channel line that is not the next expected record (forged,
duplicated, reordered, undecodable) fails the whole run. A forged
record can at most claim a value the program could have returned honestly, since the program
never sees what the value is compared with.

Not defended: comparisons made inside the sandbox — in a probe that is not split (a
comprehension, ``all(...)``, ``isinstance``), between two values of the program, and in test
statements that are neither top-level asserts nor an inlined checker (a ``check`` function with
a loop) — can be subverted by a program that tampers with its own process, and values a test
block computes there (``expected = ...``) are visible to it. The hack catalogue in
docs/tasks.md lists what is defended and why.

The parts: :mod:`.split` (tests → plan), :mod:`.runner` (the sandboxed side, shipped as
source), :mod:`.channel` (the program to run, and the judgement of its records).

Knows nothing about datasets, rewards or the sandbox's modes: test code and a program in, a
program to run; that run's stdout in, an :class:`Outcome`.
"""

from swarmrl.envs.harness.channel import Outcome, judge, program, read_records
from swarmrl.envs.harness.split import Plan, plan

__all__ = ["Outcome", "Plan", "judge", "plan", "program", "read_records"]
