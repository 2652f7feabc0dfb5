"""swarmrl.envs: verifiable environments behind the :class:`Environment` interface, and
:func:`build_env`, which picks one from config.

Built in: ``arith``, ``reverse``, ``code_tiny`` (no dependencies); ``tool_arith`` and
``guess``, multi-turn episodes (:mod:`swarmrl.envs.multiturn`); ``math`` and ``code``
(datasets read through Hugging Face ``datasets``); ``reasoning_gym`` and ``verifiers`` (those
libraries' tasks; ``verifiers`` the classic interface of verifiers < 0.4) and ``verifiers_v1``
(a verifiers 0.4 taskset played by its harness, :mod:`swarmrl.envs.vf1`). The optional libraries install with ``pip install 'swarmrl[tasks]'`` and are
imported only by the environment that needs them. Wrappers: a filtered training subset
(``env.train_subset``) and the length budget.
"""

from __future__ import annotations

from swarmrl.config.env import EnvConfig, SandboxConfig
from swarmrl.envs.arith import ArithEnv
from swarmrl.envs.base import SPLITS, Environment, Score, Split, Task
from swarmrl.envs.budget import LengthBudgetEnv, budget_reward
from swarmrl.envs.guess import GuessEnv
from swarmrl.envs.mathtask import MathEnv
from swarmrl.envs.multiturn import MultiTurnEnvironment
from swarmrl.envs.reverse import ReverseEnv
from swarmrl.envs.sandbox import Limits, PromptsOnly, Sandbox
from swarmrl.envs.subset import SubsetEnv, read_problem_ids
from swarmrl.envs.tool_arith import ToolArithEnv
from swarmrl.errors import ConfigError

__all__ = [
    "SPLITS",
    "ArithEnv",
    "Environment",
    "GuessEnv",
    "LengthBudgetEnv",
    "MathEnv",
    "MultiTurnEnvironment",
    "ReverseEnv",
    "Score",
    "Split",
    "SubsetEnv",
    "Task",
    "ToolArithEnv",
    "budget_reward",
    "build_env",
    "build_sandbox",
]


def _dataset(config: EnvConfig) -> str:
    if not config.dataset:
        raise ConfigError(
            f"env.name = {config.name!r} needs env.dataset (a file, a directory or a hub id)"
        )
    return config.dataset


def _base_env(config: EnvConfig, scores: bool) -> Environment:
    if config.name == "arith":
        return ArithEnv(config.digits, config.heldout_fraction)
    if config.name in ("tool_arith", "guess"):
        limits = {
            key: value
            for key, value in (
                ("max_turns", config.max_turns),
                ("token_budget", config.token_budget),
            )
            if value is not None
        }
        if config.name == "tool_arith":
            return ToolArithEnv(config.digits, config.heldout_fraction, **limits)
        return GuessEnv(
            config.guess_n, config.heldout_fraction, ranges=config.guess_ranges, **limits
        )
    if config.name == "reverse":
        return ReverseEnv(config.reverse_len, config.heldout_fraction)
    if config.name == "math":
        return MathEnv(
            _dataset(config),
            config.heldout_fraction,
            config.problem_column,
            config.answer_column,
            config.answer_format,
            config.dataset_split,
            config.dataset_config,
            config.solution_column,
        )
    if config.name == "reasoning_gym":
        from swarmrl.envs.gym import ReasoningGymEnv

        return ReasoningGymEnv(
            config.tasks,
            config.size,
            config.seed,
            config.heldout_fraction,
            partial_credit=config.partial_credit,
        )
    if config.name == "verifiers":
        from swarmrl.envs.vfenv import VerifiersEnv

        if not config.verifiers_env:
            raise ConfigError("env.name = 'verifiers' needs env.verifiers_env (an environment id)")
        return VerifiersEnv(config.verifiers_env, config.verifiers_args, config.heldout_fraction)
    if config.name == "verifiers_v1":
        from swarmrl.envs.vf1 import VerifiersV1Env

        if not config.verifiers_env:
            raise ConfigError("env.name = 'verifiers_v1' needs env.verifiers_env (a taskset id)")
        return VerifiersV1Env(
            config.verifiers_env,
            config.verifiers_args,
            config.verifiers_harness,
            config.verifiers_harness_args,
            config.heldout_fraction,
            config.verifiers_timeout_s,
            config.verifiers_reexecute,
        )
    if config.name in ("code", "code_tiny"):
        from swarmrl.envs.code import CodeEnv, CodeTinyEnv

        sandbox = build_sandbox(config.sandbox) if scores else PromptsOnly()
        if config.name == "code_tiny":
            return CodeTinyEnv(sandbox, config.heldout_fraction)
        return CodeEnv(
            _dataset(config),
            sandbox,
            config.heldout_fraction,
            config.problem_column,
            config.tests_column,
            config.dataset_split,
            config.dataset_config,
        )
    # the config schema already restricts the name
    raise ConfigError(f"unknown environment {config.name!r}")


def build_sandbox(config: SandboxConfig) -> Sandbox:
    """The code sandbox ``config`` describes, started and probed (or a one-line error)."""
    limits = Limits(
        cpu_s=config.cpu_s,
        wall_s=config.wall_s,
        memory_mb=config.memory_mb,
        processes=config.processes,
        output_bytes=config.output_bytes,
        file_mb=config.file_mb,
    )
    return Sandbox(limits, config.mode, config.python)


def build_env(config: EnvConfig, scores: bool = True) -> Environment:
    """The environment ``config`` names, on its filtered subset and with the length budget
    when those are configured. ``scores=False`` is for a process that only draws tasks and
    builds prompts (a worker): no code sandbox is started for it, so a machine without one can
    still generate, and scoring there is a :class:`SandboxError`."""
    env = _base_env(config, scores)
    if isinstance(env, MultiTurnEnvironment) and (
        config.train_subset or config.length_budget.enabled
    ):
        raise ConfigError(
            f"env.name = {config.name!r} is multi-turn: env.train_subset and env.length_budget "
            "apply to single-turn tasks only"
        )
    if config.system_prompt is not None:
        env.system_prompt = config.system_prompt
    if config.train_subset:
        env = SubsetEnv(env, read_problem_ids(config.train_subset), config.train_subset)
    budget = config.length_budget
    if budget.enabled:
        env = LengthBudgetEnv(env, budget.targets, budget.alpha, budget.mode)
    return env
