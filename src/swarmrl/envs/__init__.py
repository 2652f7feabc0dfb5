"""swarmrl.envs: verifiable environments (``arith``, ``reverse``, ``math``) and the length-budget
wrapper, all behind the :class:`Environment` interface; :func:`build_env` picks one from config.
"""

from __future__ import annotations

from swarmrl.config.env import EnvConfig
from swarmrl.envs.arith import ArithEnv
from swarmrl.envs.base import SPLITS, Environment, Score, Split, Task
from swarmrl.envs.budget import LengthBudgetEnv, budget_reward
from swarmrl.envs.mathtask import MathEnv
from swarmrl.envs.reverse import ReverseEnv
from swarmrl.errors import ConfigError

__all__ = [
    "SPLITS",
    "ArithEnv",
    "Environment",
    "LengthBudgetEnv",
    "MathEnv",
    "ReverseEnv",
    "Score",
    "Split",
    "Task",
    "budget_reward",
    "build_env",
]


def build_env(config: EnvConfig) -> Environment:
    """The environment ``config`` names, wrapped with the length budget when enabled."""
    env: Environment
    if config.name == "arith":
        env = ArithEnv(config.digits, config.heldout_fraction)
    elif config.name == "reverse":
        env = ReverseEnv(config.reverse_len, config.heldout_fraction)
    elif config.name == "math":
        if not config.dataset:
            raise ConfigError("env.name = 'math' needs env.dataset (a .jsonl or .parquet file)")
        env = MathEnv(config.dataset, config.heldout_fraction)
    else:  # the config schema already restricts the name
        raise ConfigError(f"unknown environment {config.name!r}")
    budget = config.length_budget
    if budget.enabled:
        env = LengthBudgetEnv(env, budget.targets, budget.alpha, budget.mode)
    return env
