"""``tool_arith``: a product the model cannot compute, and a calculator it can call.

Prompt ``347*582=``. The model may call the calculator (``c``, the compact tool-call format of
``swarmrl.envs.multiturn``) and read its answer, then answer::

    347*582=  │ c(347*582)<eos> │ [201954] │ 201954<eos>
     prompt   │ model turn 0    │ env      │ model turn 1 (the answer: not a call)

The environment answers a call with ``[RESULT]`` (``[?]`` when the call does not parse or
names another tool) and ends the episode at the first turn that is not a call. Reward: 1 when
that answer equals the product, else 0; at most ``max_turns`` model turns (a model that only
calls never answers).

The warm start's characteristic mistake (``flawed=True``) is answering at once, without the
tool, with the product rounded to thousands (``201954`` → ``202000``): a demo-size model cannot
multiply three-digit numbers, so imitating a mix in which most answers skip the tool leaves
greedy decoding answering wrong, while sampling still calls the tool often enough for the
exact-match reward to find it.

Knows nothing about tokens or models.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarmrl.envs.base import Score, Task
from swarmrl.envs.multiturn import (
    Calculator,
    Message,
    MultiTurnEnvironment,
    Reply,
    model_turns,
    parse_tool_call,
)
from swarmrl.errors import ToolError

TOOL = "c"  # the calculator's name in the compact format


class ToolArithEnv(MultiTurnEnvironment):
    """``digits``-digit × ``digits``-digit products with a calculator tool."""

    name = "tool_arith"
    alphabet = "0123456789*=c()[]?"

    def __init__(
        self,
        digits: int = 3,
        heldout_fraction: float = 0.1,
        max_turns: int = 3,
        token_budget: int = 64,
    ) -> None:
        super().__init__(heldout_fraction)
        self.digits, self.max_turns, self.token_budget = digits, max_turns, token_budget
        self._low = 10 ** (digits - 1) if digits > 1 else 0
        self._span = 10**digits - self._low
        self.calculator = Calculator(max_digits=2 * digits + 1)

    def space_size(self) -> int:
        return self._span * self._span

    def operands(self, problem_id: int) -> tuple[int, int]:
        return self._low + problem_id // self._span, self._low + problem_id % self._span

    def problem(self, problem_id: int) -> tuple[str, str]:
        a, b = self.operands(problem_id)
        return f"{a}*{b}=", str(a * b)

    def reply(self, task: Task, seed: int, transcript: Sequence[Message]) -> Reply:
        call = parse_tool_call(transcript[-1].text)
        if call is None:
            return Reply(done=True)  # an answer
        if call.name != TOOL:
            return Reply("[?]")
        try:
            return Reply(f"[{self.calculator.call(call.arguments)}]")
        except ToolError:
            return Reply("[?]")

    def score_episode(self, task: Task, seed: int, transcript: Sequence[Message]) -> Score:
        turns = model_turns(transcript)
        answer = turns[-1].strip() if turns else ""
        called = any(parse_tool_call(t) is not None for t in turns)
        correct = parse_tool_call(answer) is None and answer == task.answer
        return Score(
            1.0 if correct else 0.0,
            {"correct": correct, "turns": len(turns), "called_tool": called},
        )

    def demonstration_turns(self, task: Task, flawed: bool = False) -> list[str]:
        a, b = self.operands(task.problem_id)
        if flawed:
            return [str(round(a * b, -3))]
        return [f"{TOOL}({a}*{b})", task.answer]
