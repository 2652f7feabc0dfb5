"""Colocated mode: generation and training in one process, one step after the other.

    warm start (cached) → eval before → for each step:
        sample G completions for each of the step's prompts with the current policy
        (online filter: drop all-equal groups, draw more) → collate → policy_step
        → load the new weights into the engine (policy version + 1)
    → eval after → control (the warm start's SFT continued for the RL wall time) → eval

It runs the same :func:`~swarmrl.trainer.step.policy_step` as the swarm trainer; the behaviour
log-probs of the ratio are those the generating engine reported. Everything random derives from
``run.seed``, so the same seed on the same machine gives the same per-step metrics.

Knows nothing about files or displays: each step's metrics go to ``on_step``; the caller
records them (``swarmrl.launch.report``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmrl.config import SwarmConfig
from swarmrl.envs import build_env
from swarmrl.inference.engine import TorchEngine
from swarmrl.trainer.batch import collate
from swarmrl.trainer.evaluate import evaluate
from swarmrl.trainer.rollout import RolloutSampler
from swarmrl.trainer.step import make_optimizer, policy_step
from swarmrl.trainer.warmstart import (
    WarmStart,
    continue_warm_start,
    ensure_warm_start,
    load_start_policy,
)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


@dataclass
class Hooks:
    """What the caller wants to hear about while the run proceeds (all optional)."""

    on_phase: Callable[[str], None] = lambda phase: None
    on_sft_step: Callable[[int, float], None] | None = None
    on_step: Callable[[dict[str, Any]], None] = lambda row: None
    on_eval: Callable[[str, dict[str, Any]], None] = lambda name, result: None


@dataclass
class ColocatedResult:
    steps: int
    rl_seconds: float
    warm_start: WarmStart
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)
    control_steps: int = 0
    policy: Any = None
    tokenizer: Any = None


def run_colocated(config: SwarmConfig, hooks: Hooks | None = None) -> ColocatedResult:
    hooks = hooks or Hooks()
    torch.set_num_threads(config.run.threads)
    device = resolve_device(config.run.device)
    rl, seed = config.rl, config.run.seed
    env = build_env(config.env)

    hooks.on_phase("warm start")
    warm = ensure_warm_start(config, env, on_step=hooks.on_sft_step)
    policy, tokenizer = load_start_policy(config, warm, device)
    engine = TorchEngine(copy.deepcopy(policy), tokenizer, device)
    reference = copy.deepcopy(policy).eval() if rl.kl_coef > 0 else None

    def run_eval(eval_engine: TorchEngine) -> dict[str, Any]:
        return evaluate(
            env, eval_engine, tokenizer, config.eval.n, config.eval.samples, rl.sampling, seed
        )

    result = ColocatedResult(steps=0, rl_seconds=0.0, warm_start=warm)
    hooks.on_phase("eval before")
    result.evals["before"] = run_eval(engine)
    hooks.on_eval("before", result.evals["before"])

    hooks.on_phase("rl")
    torch.manual_seed(seed)
    optimizer = make_optimizer(policy, rl)
    sampler = RolloutSampler(env, engine, tokenizer, rl, seed)
    version = 0
    start = time.perf_counter()
    for step in range(rl.steps):
        step_start = time.perf_counter()
        groups, rollout = sampler.batch(step, version)
        row: dict[str, Any] = {
            "step": step,
            "policy_version": version,
            "reward_mean": rollout.reward_mean,
            "accuracy": rollout.accuracy,
            "groups_sampled": rollout.groups_sampled,
            "groups_kept": rollout.groups_kept,
        }
        if groups:
            batch = collate(groups, engine.pad_id, rl.advantage)
            stats = policy_step(policy, optimizer, batch, rl, reference, rl.micro_batch)
            engine.load_state_dict(policy.state_dict())
            version += 1
            row |= {
                "loss": stats.loss,
                "clip_fraction": stats.clip_fraction,
                "grad_norm": stats.grad_norm,
                "entropy": stats.entropy,
                "kl": stats.kl,
            }
        else:  # every group was uninformative even after backfilling: nothing to learn from
            row |= {
                "loss": None,
                "clip_fraction": None,
                "grad_norm": None,
                "entropy": None,
                "kl": None,
            }
        elapsed = time.perf_counter() - step_start
        row["tokens_per_s"] = rollout.tokens / elapsed if elapsed > 0 else 0.0
        row["wall_time"] = time.perf_counter() - start
        hooks.on_step(row)
    result.steps = rl.steps
    result.rl_seconds = time.perf_counter() - start

    hooks.on_phase("eval after")
    result.evals["after"] = run_eval(engine)
    hooks.on_eval("after", result.evals["after"])
    if config.eval.control and config.model.path is None:
        hooks.on_phase("control")
        control, _, control_steps = continue_warm_start(config, env, warm, result.rl_seconds)
        result.control_steps = control_steps
        result.evals["control"] = run_eval(TorchEngine(control, tokenizer, device))
        result.evals["control"]["sft_steps"] = control_steps
        hooks.on_eval("control", result.evals["control"])
    result.policy, result.tokenizer = policy, tokenizer
    return result
