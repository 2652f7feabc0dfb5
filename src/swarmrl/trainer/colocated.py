"""Colocated mode: generation and training in one process, one step after the other.

The training loop (:func:`swarmrl.trainer.loop.train`) over the in-process engine source
(:class:`swarmrl.trainer.rollout.EngineSource`): the engine generates with a copy of the
policy and, after each step, loads the new weights. The behaviour log-probs of the ratio are
those the generating engine reported. Everything random derives from ``run.seed``, so the same
seed on the same machine gives the same per-step metrics.

Knows nothing about files or displays: the caller records the result
(``swarmrl.launch.report``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.config import SwarmConfig
from swarmrl.envs import build_env
from swarmrl.trainer.engines import policy_engine
from swarmrl.trainer.learner import Learner
from swarmrl.trainer.loop import Hooks, TrainingResult, train
from swarmrl.trainer.rollout import EngineSource, RolloutSampler


@dataclass
class ColocatedRun:
    """The loop's result and the trained policy (to save beside the report)."""

    result: TrainingResult
    policy: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


def run_colocated(
    config: SwarmConfig,
    hooks: Hooks | None = None,
    on_sft_step: Callable[[int, float], None] | None = None,
) -> ColocatedRun:
    hooks = hooks or Hooks()
    torch.set_num_threads(config.run.threads)
    env = build_env(config.env)
    hooks.on_phase("warm start")
    learner = Learner(config, env, on_sft_step)
    engine = policy_engine(config, learner.policy, learner.tokenizer, learner.device)
    try:
        sampler = RolloutSampler(env, engine, learner.tokenizer, config.rl, config.run.seed)
        try:
            result = train(config, learner, EngineSource(sampler, learner.policy), hooks)
        finally:
            sampler.close()
    finally:
        engine.close()
        learner.close()
    return ColocatedRun(result, learner.policy, learner.tokenizer)
