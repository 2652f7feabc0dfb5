"""``arith``: d-digit + d-digit addition, answer written with its digits reversed.

Prompt ``123+456=``, answer ``975`` (579 reversed) then EOS. Reversed order lets a causal model
emit the least significant digit first, the order in which carries are computed, and a tiny
model learns it far faster than normal order. Reward: 1 for an exact match, else 0.

The warm start's characteristic mistake (``demonstration(..., flawed=True)``) is forgetting the
final carry: when the sum has one digit more than the operands, the flawed answer drops that
leading 1 (``658+467=`` → ``521`` instead of ``5211``). Imitating a mix in which most such
answers are flawed plateaus, while the exact-match reward tells the policy which habit is right.

Knows nothing about tokens or models.
"""

from __future__ import annotations

from swarmrl.envs.base import Environment, Score, Task


class ArithEnv(Environment):
    """Addition of two ``digits``-digit numbers (no leading zeros), reversed-digit answers."""

    name = "arith"
    alphabet = "0123456789+="

    def __init__(self, digits: int = 3, heldout_fraction: float = 0.1) -> None:
        super().__init__(heldout_fraction)
        self.digits = digits
        self._low = 10 ** (digits - 1) if digits > 1 else 0
        self._span = 10**digits - self._low

    def space_size(self) -> int:
        return self._span * self._span

    def operands(self, problem_id: int) -> tuple[int, int]:
        return self._low + problem_id // self._span, self._low + problem_id % self._span

    def problem(self, problem_id: int) -> tuple[str, str]:
        a, b = self.operands(problem_id)
        return f"{a}+{b}=", str(a + b)[::-1]

    def demonstration(self, task: Task, flawed: bool = False) -> str:
        if not flawed:
            return task.answer
        a, b = self.operands(task.problem_id)
        return str((a + b) % 10**self.digits).zfill(self.digits)[::-1]

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        correct = completion_text.strip() == task.answer
        return Score(reward=1.0 if correct else 0.0, details={"correct": correct})
