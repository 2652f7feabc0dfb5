"""``reverse``: write a string backwards, with partial credit.

Prompt ``abcdef:``, answer ``fedcba``. Reward = (positions where the completion matches the
answer) / max(len(answer), len(completion)), so both wrong characters and extra or missing
ones cost. ``correct`` in the details means an exact match.

The warm start's characteristic mistake: the first two characters of the answer swapped.

Knows nothing about tokens or models.
"""

from __future__ import annotations

from swarmrl.envs.base import Environment, Score, Task

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def positional_match(answer: str, completion: str) -> float:
    """Share of aligned positions that agree, over the longer of the two strings."""
    longest = max(len(answer), len(completion))
    if longest == 0:
        return 1.0
    return sum(x == y for x, y in zip(answer, completion, strict=False)) / longest


class ReverseEnv(Environment):
    """Strings of ``length`` lowercase letters; the answer is the string reversed."""

    name = "reverse"
    alphabet = LETTERS + ":"

    def __init__(self, length: int = 6, heldout_fraction: float = 0.1) -> None:
        super().__init__(heldout_fraction)
        self.length = length

    def space_size(self) -> int:
        return len(LETTERS) ** self.length

    def text(self, problem_id: int) -> str:
        chars = []
        for _ in range(self.length):
            problem_id, digit = divmod(problem_id, len(LETTERS))
            chars.append(LETTERS[digit])
        return "".join(chars)

    def problem(self, problem_id: int) -> tuple[str, str]:
        text = self.text(problem_id)
        return f"{text}:", text[::-1]

    def demonstration(self, task: Task, flawed: bool = False) -> str:
        if not flawed or len(task.answer) < 2:
            return task.answer
        return task.answer[1] + task.answer[0] + task.answer[2:]

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        text = completion_text.strip()
        return Score(
            reward=positional_match(task.answer, text), details={"correct": text == task.answer}
        )
