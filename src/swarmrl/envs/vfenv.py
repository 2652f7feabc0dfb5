"""``verifiers``: a single-turn environment of the ``verifiers`` library run as a swarmrl
environment, its rubric scoring on the trusted side.

``env.verifiers_env`` is the id given to ``verifiers.load_environment`` (an installed environment
package, or any importable module with a ``load_environment`` function), with
``env.verifiers_args`` as its keyword arguments. Supported: the classic environment interface
(verifiers 0.1.3 – 0.3.x, ``verifiers.legacy`` in 0.3) for ``SingleTurnEnv`` and other
environments limited to one turn, chat or completion style. Its ``dataset`` (or
``eval_dataset`` when there is no ``dataset``) is the problem space and swarmrl's own split
divides it; each row's prompt is the system message (when present) and one user message, which
the tokenizer's chat template renders (``env.system_prompt`` replaces the row's system message
when set). A completion is scored by the environment's rubric as one assistant message; the
rubric's weighted sum is the reward, clipped to [0, 1] (``raw_reward`` keeps the sum);
``correct`` means a reward of 1.

Not supported: multi-turn and tool environments, few-shot message lists, group-level reward
functions, reward functions that call a model (judges) or the network, and verifiers 0.4's
``v1`` taskset/harness interface. Each is a one-line :class:`ConfigError` at start-up.

Knows nothing about tokens or models.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from swarmrl.envs.base import Environment, Score, Split, Task
from swarmrl.envs.data import require
from swarmrl.errors import ConfigError, DatasetError


def _load(env_id: str, args: dict[str, Any]) -> Any:
    vf = require("verifiers", "env.name = 'verifiers'")
    if not hasattr(vf, "load_environment"):
        version = getattr(vf, "__version__", "?")
        raise ConfigError(
            f"env.name = 'verifiers' is the classic interface, gone from verifiers {version}: "
            'pip install "verifiers<0.4", or name a verifiers 0.4 taskset with '
            "env.name = 'verifiers_v1'"
        )
    try:
        return vf.load_environment(env_id, **args)
    except (ValueError, RuntimeError, TypeError) as exc:
        raise ConfigError(f"env.verifiers_env {env_id!r}: {str(exc).splitlines()[0]}") from exc


def _run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coroutine`` to completion from sync code, also when this thread runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _turns(env: Any) -> int | None:
    return getattr(env, "max_turns", None)


class VerifiersEnv(Environment):
    """The rows of a single-turn ``verifiers`` environment; its rubric gives the reward."""

    name = "verifiers"
    alphabet = None

    def __init__(
        self, env_id: str, args: dict[str, Any] | None = None, heldout_fraction: float = 0.1
    ) -> None:
        super().__init__(heldout_fraction)
        self.vf_env = _load(env_id, args or {})
        turns = _turns(self.vf_env)
        if turns != 1:
            kind = type(self.vf_env).__name__
            raise ConfigError(
                f"env.verifiers_env {env_id!r} is a {kind} with max_turns={turns}; "
                "only single-turn environments are supported"
            )
        data = self.vf_env.dataset if self.vf_env.dataset is not None else None
        if data is None:
            data = self.vf_env.eval_dataset
        if data is None or len(data) < 2:
            raise ConfigError(f"env.verifiers_env {env_id!r}: needs a dataset of at least 2 rows")
        self.chat = getattr(self.vf_env, "message_type", "chat") == "chat"
        self.rows: list[dict[str, Any]] = [dict(row) for row in data]
        self.prompts = [self._prompt(env_id, i, row) for i, row in enumerate(self.rows)]

    def _prompt(self, env_id: str, i: int, row: dict[str, Any]) -> tuple[str | None, str]:
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            return None, prompt
        roles = [m.get("role") for m in prompt] if isinstance(prompt, list) else []
        if roles == ["user"]:
            return None, str(prompt[0]["content"])
        if roles == ["system", "user"]:
            return str(prompt[0]["content"]), str(prompt[1]["content"])
        raise DatasetError(
            f"verifiers {env_id!r} row {i + 1}: prompt must be [system?, user], got roles {roles}"
        )

    def space_size(self) -> int:
        return len(self.rows)

    def problem(self, problem_id: int) -> tuple[str, str]:
        return self.prompts[problem_id][1], str(self.rows[problem_id].get("answer", ""))

    def task(self, split: Split, index: int) -> Task:
        base = super().task(split, index)
        # ``env.system_prompt`` where set, else the row's own system turn
        return replace(base, system=self.system_prompt or self.prompts[base.problem_id][0])

    def record(self, problem_id: int) -> dict[str, Any]:
        return self.rows[problem_id]

    def score(self, task: Task, completion_text: str, num_tokens: int | None = None) -> Score:
        from verifiers.types import State

        row = self.rows[task.problem_id]
        state = State(
            input={
                "prompt": row.get("prompt"),
                "answer": row.get("answer", ""),
                "info": row.get("info") or {},
                "example_id": row.get("example_id", task.problem_id),
                "task": row.get("task", "default"),
            }
        )
        state["completion"] = (
            [{"role": "assistant", "content": completion_text}] if self.chat else completion_text
        )
        state["trajectory"] = []
        _run(self.vf_env.rubric.score_rollout(state))
        raw = float(state.get("reward") or 0.0)
        reward = min(1.0, max(0.0, raw)) if raw == raw else 0.0
        return Score(reward, {"correct": reward == 1.0, "raw_reward": raw})
