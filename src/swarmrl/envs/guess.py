"""``guess``: find a hidden number in ``1..N`` from higher/lower feedback, in few turns.

Prompt ``1-32?``. Each model turn is a guess; the environment answers ``<`` (the number is
lower), ``>`` (higher) or ``?`` (not a number in 1..N), followed by the range still possible
given every answer so far, and ends the episode when the guess is right::

    1-32?  │ 16<eos> │ <1-15 │ 8<eos> │ >9-15 │ 12<eos>     (hidden 12: found in 3 turns)

Restating the range makes the policy's next move a function of the last reply (the midpoint
of the range it states) rather than of the whole history.

Without ``ranges`` every problem starts from ``1-N?``, the problem space is the hidden numbers,
and held-out problems are numbers never hidden in training; a held-out number's last range
(``h-h``) is then one no training episode ends in, and the demo-size model does not learn to
copy it from the training numbers. With ``ranges=True`` a problem is a starting range and a
number in it (``9-20?``, every range of at least two numbers in 1..N): held-out problems are
(range, number) pairs never played in training, while every number is hidden in some training
range, so the one-number range ``h-h`` that ends a search is one training episodes reach for
every ``h`` (docs/tasks.md has the runs of both).

Reward: 0 unless the number is found within ``max_turns`` guesses, else
``1 − 0.5·(turns − 1)/max_turns``: every turn saved is worth something, so the policy is pushed
toward bisection, whose worst case is ⌈log2(L+1)⌉ guesses for a range of L numbers.

The warm start's characteristic mistake (``flawed=True``) is searching by quarters instead of
halves (guess ``lo + (hi − lo) // 4``): it still narrows the range, but too slowly to finish
within the turn limit for many numbers (most of 1..64 from ``1-64?``; one in eight of the
starting ranges in 1..64), so imitating a mix in which most episodes search by quarters leaves
greedy decoding failing there, while sampling bisects often enough to be rewarded.

Knows nothing about tokens or models.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarmrl.envs.base import Score, Task
from swarmrl.envs.multiturn import Message, MultiTurnEnvironment, Reply, model_turns

MAX_RANGES_N = 1024  # with starting ranges the problem space grows as n³/6


def _per_lo(longest: int) -> int:
    """Problems whose range starts at one ``lo``: ranges of 2..``longest`` numbers, each
    holding as many hidden numbers as it is long."""
    return longest * (longest + 1) // 2 - 1


def possible_range(
    hidden: int, guesses: Sequence[str], n: int, start: tuple[int, int] | None = None
) -> tuple[int, int]:
    """The range of numbers still possible after the feedback to ``guesses``, from ``start``
    (``1..n`` unless given)."""
    lo, hi = start or (1, n)
    for text in guesses:
        sign = guess_feedback(hidden, text, n)
        if sign == "<":
            hi = min(hi, int(text) - 1)
        elif sign == ">":
            lo = max(lo, int(text) + 1)
    return lo, hi


def guess_feedback(hidden: int, text: str, n: int) -> str:
    """``=`` (found), ``<`` (hidden is lower), ``>`` (higher) or ``?`` (not a number 1..n)."""
    text = text.strip()
    if not text.isdigit() or not 1 <= int(text) <= n:
        return "?"
    value = int(text)
    return "=" if value == hidden else ("<" if hidden < value else ">")


class GuessEnv(MultiTurnEnvironment):
    """Hidden number in ``1..n``; higher/lower feedback."""

    name = "guess"
    alphabet = "0123456789<>=?-"

    def __init__(
        self,
        n: int = 32,
        heldout_fraction: float = 0.25,
        max_turns: int = 6,
        token_budget: int = 96,
        ranges: bool = False,
    ) -> None:
        super().__init__(heldout_fraction)
        if ranges and not 2 <= n <= MAX_RANGES_N:
            raise ValueError(f"guess with starting ranges needs 2 <= n <= {MAX_RANGES_N}, got {n}")
        self.n, self.max_turns, self.token_budget = n, max_turns, token_budget
        self.ranges = ranges

    def space_size(self) -> int:
        # with ranges: for each lo, the ranges lo..lo+L-1 (L = 2..n-lo+1), each with L numbers
        return sum(_per_lo(self.n - lo + 1) for lo in range(1, self.n)) if self.ranges else self.n

    def start_and_hidden(self, problem_id: int) -> tuple[tuple[int, int], int]:
        """``((lo, hi), hidden)`` of problem ``problem_id``."""
        if not self.ranges:
            return (1, self.n), problem_id + 1
        left = problem_id
        for lo in range(1, self.n):
            count = _per_lo(self.n - lo + 1)
            if left >= count:
                left -= count
                continue
            for length in range(2, self.n - lo + 2):
                if left < length:
                    return (lo, lo + length - 1), lo + left
                left -= length
        raise IndexError(f"guess: problem {problem_id} outside 0..{self.space_size() - 1}")

    def hidden(self, task: Task) -> int:
        return self.start_and_hidden(task.problem_id)[1]

    def problem(self, problem_id: int) -> tuple[str, str]:
        (lo, hi), hidden = self.start_and_hidden(problem_id)
        return f"{lo}-{hi}?", str(hidden)

    def reply(self, task: Task, seed: int, transcript: Sequence[Message]) -> Reply:
        start, hidden = self.start_and_hidden(task.problem_id)
        feedback = guess_feedback(hidden, transcript[-1].text, self.n)
        if feedback == "=":
            return Reply(done=True)
        lo, hi = possible_range(hidden, model_turns(transcript), self.n, start)
        return Reply(f"{feedback}{lo}-{hi}")

    def score_episode(self, task: Task, seed: int, transcript: Sequence[Message]) -> Score:
        turns = model_turns(transcript)
        found = bool(turns) and guess_feedback(self.hidden(task), turns[-1], self.n) == "="
        found = found and len(turns) <= self.max_turns
        reward = 1.0 - 0.5 * (len(turns) - 1) / self.max_turns if found else 0.0
        return Score(reward, {"correct": found, "turns": len(turns)})

    def demonstration_turns(self, task: Task, flawed: bool = False) -> list[str]:
        (lo, hi), hidden = self.start_and_hidden(task.problem_id)
        turns: list[str] = []
        while len(turns) < self.max_turns + 4:
            guess = lo + (hi - lo) // 4 if flawed else (lo + hi) // 2
            turns.append(str(guess))
            if guess == hidden:
                break
            lo, hi = (lo, guess - 1) if hidden < guess else (guess + 1, hi)
        return turns[: self.max_turns]
