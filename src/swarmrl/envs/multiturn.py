"""Multi-turn environments: the environment's next turn as a pure function of the transcript.

An episode alternates model turns and environment turns, starting with the task's prompt::

    prompt → model 0 → env 0 → model 1 → env 1 → … → model k   (then the episode is scored)

After each model turn the environment answers with :meth:`MultiTurnEnvironment.reply`, a pure
function of ``(task, seed, transcript)`` (the transcript: every turn so far, as text), so the
trusted side can recompute every environment turn an untrusted worker claims. A reply is either
a text (the next environment turn) or ``done`` (the episode ends after that model turn). An
episode also ends after ``max_turns`` model turns, or when its ``token_budget`` (model plus
environment tokens after the prompt) has no room for another model token; the token-level
driver (``swarmrl.trainer.episodes``) enforces both. :meth:`score_episode` gives the whole
episode's reward from its transcript.

Tool calls (the format every built-in task and :func:`parse_tool_call` use): a model turn is a
tool call when its whole text (stripped) is either

- compact: ``NAME(ARGUMENTS)``, e.g. ``c(347*582)``: NAME one or more letters, ARGUMENTS the
  text between the first ``(`` and the final ``)``; this is what character-vocabulary tasks use;
- JSON, the Hermes/Qwen chat-template convention:
  ``<tool_call>{"name": "calc", "arguments": {"expression": "347*582"}}</tool_call>``, the
  argument being the single string value of ``arguments``.

A turn that is neither is not a call (an answer). A call of an unknown tool, or one whose
arguments its tool refuses, is answered with the environment's error text, not a crash.

Tools (:class:`Tool`): :class:`Calculator` evaluates integer arithmetic itself (it parses a
grammar, it runs no code); :class:`PythonTool` runs a program in the code sandbox
(``swarmrl.envs.sandbox``) and answers with its output. Only deterministic tools belong in an
environment whose turns are to be recomputed: a tool that reads the outside world cannot be.

Knows nothing about tokens or models: turns are text.
"""

from __future__ import annotations

import ast
import json
import re
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from swarmrl.envs.base import Environment, Score, Task
from swarmrl.envs.sandbox import Sandbox
from swarmrl.errors import ConfigError, ToolError

Speaker = Literal["model", "env"]
_COMPACT = re.compile(r"^([A-Za-z]+)\((.*)\)$", re.S)
_HERMES = re.compile(r"^<tool_call>(.*)</tool_call>$", re.S)


@dataclass(frozen=True)
class Message:
    """One turn of a transcript: who wrote it and its text (special tokens stripped)."""

    speaker: Speaker
    text: str


@dataclass(frozen=True)
class Reply:
    """The environment's answer to a model turn: the next turn's text, or the episode's end."""

    text: str = ""
    done: bool = False


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str


def parse_tool_call(text: str) -> ToolCall | None:
    """The tool call ``text`` is (module docstring), or None when it is not one."""
    text = text.strip()
    hermes = _HERMES.match(text)
    if hermes:
        try:
            call = json.loads(hermes.group(1))
        except json.JSONDecodeError:
            return ToolCall("", "")  # a call in form, unreadable: the tool answers an error
        args = call.get("arguments") if isinstance(call, dict) else None
        values = list(args.values()) if isinstance(args, dict) else []
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str) or len(values) != 1 or not isinstance(values[0], str):
            return ToolCall("", "")
        return ToolCall(name, values[0])
    compact = _COMPACT.match(text)
    if compact:
        return ToolCall(compact.group(1), compact.group(2))
    return None


class Tool:
    """A function a model may call by name; ``call`` is deterministic in its argument."""

    name: str = "tool"

    @abstractmethod
    def call(self, arguments: str) -> str:
        """The tool's answer, or :class:`ToolError`."""


_ARITH_OPS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}


class Calculator(Tool):
    """Integer ``+ - *`` with parentheses, each number at most ``max_digits`` digits."""

    name = "calc"

    def __init__(self, max_digits: int = 12, max_length: int = 64) -> None:
        self.max_digits, self.max_length = max_digits, max_length

    def call(self, arguments: str) -> str:
        if len(arguments) > self.max_length or not re.fullmatch(r"[0-9+\-*() ]+", arguments):
            raise ToolError("not an integer expression")
        try:
            tree = ast.parse(arguments, mode="eval")
        except SyntaxError as exc:
            raise ToolError("not an integer expression") from exc
        return str(self._value(tree.body))

    def _value(self, node: ast.expr) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if len(str(node.value)) > self.max_digits:
                raise ToolError("number too long")
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self._value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            return _ARITH_OPS[type(node.op)](self._value(node.left), self._value(node.right))
        raise ToolError("not an integer expression")


class PythonTool(Tool):
    """Runs its argument as a Python program in the sandbox; answers with its stdout.

    Deterministic for deterministic programs inside the limits; a program that exceeds them
    answers with the sandbox's verdict (``timeout``, ``memory`` …), which a replay can differ on
    when the machine is loaded, so episodes that use it are recomputed with the same limits."""

    name = "python"

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def call(self, arguments: str) -> str:
        result = self.sandbox.run(arguments)
        if result.verdict != "ok":
            raise ToolError(f"error: {result.verdict}")
        return result.stdout.rstrip("\n")


class MultiTurnEnvironment(Environment):
    """A task played over several turns (module docstring).

    Subclasses implement :meth:`reply`, :meth:`score_episode` and :meth:`demonstration_turns`
    besides :meth:`space_size` and :meth:`problem`. ``score`` of a single completion is the
    score of the one-turn episode it makes.
    """

    max_turns: int = 4  # model turns per episode
    token_budget: int = 256  # model + environment tokens after the prompt
    # every environment turn is a pure function of (task, seed, transcript), so the trusted side
    # can recompute what an untrusted worker claims; False for a tool that reads the outside
    # world (a search, a clock, a web page): such an environment is refused in a pool of
    # untrusted workers (:func:`require_recomputable`)
    recomputable: bool = True

    @abstractmethod
    def reply(self, task: Task, seed: int, transcript: Sequence[Message]) -> Reply:
        """The environment's turn after ``transcript`` (which ends with a model turn)."""

    @abstractmethod
    def score_episode(self, task: Task, seed: int, transcript: Sequence[Message]) -> Score:
        """Reward of the whole episode (``details["correct"]`` and ``details["turns"]``)."""

    @abstractmethod
    def demonstration_turns(self, task: Task, flawed: bool = False) -> list[str]:
        """The model turns of a warm-start episode (the environment's replies are recomputed
        between them); ``flawed`` asks for the task's characteristic mistake."""

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        return self.score_episode(task, 0, [Message("model", completion_text)])


def require_recomputable(env: Environment) -> None:
    """:class:`ConfigError` in one line for a multi-turn environment whose turns the trusted
    side cannot recompute (``recomputable``): untrusted workers' claims about it could not be
    checked. Single-turn environments and recomputable ones pass; an environment played by a
    harness program (``untrusted_refusal``, ``swarmrl.envs.vf1``) is refused with its own line."""
    refusal = getattr(env, "untrusted_refusal", None)
    if refusal:
        raise ConfigError(refusal)
    if isinstance(env, MultiTurnEnvironment) and not env.recomputable:
        raise ConfigError(
            f"env {env.name!r} has environment turns the trusted side cannot recompute (a tool "
            "that reads the outside world); it cannot run on untrusted workers: run it with "
            "--colocated"
        )


def model_turns(transcript: Sequence[Message]) -> list[str]:
    return [m.text for m in transcript if m.speaker == "model"]
