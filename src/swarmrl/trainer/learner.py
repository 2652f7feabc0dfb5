"""The policy being trained and everything that touches its weights, the same in every mode.

A :class:`Learner` holds the policy (started from the cached warm start or ``model.path``), its
optimizer, the frozen reference policy when ``rl.kl_coef > 0``, and the policy version (the
number of optimizer steps taken). It takes one RL step on scored groups, evaluates the current
policy on held-out tasks, and runs the control arm (the warm start's SFT continued for a given
wall time).

Knows nothing about where rollouts come from or where new versions go (that is the rollout
source's business, :mod:`swarmrl.trainer.source`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.config import SwarmConfig
from swarmrl.envs import Environment
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.interface import Engine
from swarmrl.model.prompts import check_prompts_encodable
from swarmrl.trainer.batch import Group, collate
from swarmrl.trainer.engines import policy_engine
from swarmrl.trainer.evaluate import evaluate
from swarmrl.trainer.step import StepStats, make_optimizer, policy_step
from swarmrl.trainer.warmstart import (
    WarmStart,
    continue_warm_start,
    ensure_warm_start,
    load_start_policy,
)


def resolve_device(name: str) -> str:
    """``"auto"`` → ``"cuda"`` when a GPU is visible, else ``"cpu"``; other names unchanged."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


PROMPT_CHECKS = 64  # training prompts whose encoding is checked at start


class Learner:
    """The policy, its optimizer and version; one RL step; held-out evaluation; the control."""

    def __init__(
        self,
        config: SwarmConfig,
        env: Environment,
        on_sft_step: Callable[[int, float], None] | None = None,
    ) -> None:
        self.config, self.env = config, env
        self.device = resolve_device(config.run.device)
        self.warm: WarmStart = ensure_warm_start(config, env, on_step=on_sft_step)
        self.policy: PreTrainedModel
        self.tokenizer: PreTrainedTokenizerBase
        self.policy, self.tokenizer = load_start_policy(config, self.warm, self.device)
        check_prompts_encodable(
            self.tokenizer, [*env.first("train", PROMPT_CHECKS), *env.first("heldout", 8)]
        )
        self.reference = (
            copy.deepcopy(self.policy).eval() if config.rl.kl_coef > 0 else None
        )  # frozen π_ref of the KL term
        torch.manual_seed(config.run.seed)
        self.optimizer = make_optimizer(self.policy, config.rl)
        self.version = 0  # optimizer steps taken
        self._eval_engine: Engine | None = None  # vLLM only: started once, reloaded per eval

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else 0

    def step(self, groups: list[Group]) -> StepStats:
        """One optimizer step on ``groups``; the ratio is against their behaviour log-probs."""
        rl = self.config.rl
        batch = collate(groups, self.pad_id, rl.advantage)
        stats = policy_step(self.policy, self.optimizer, batch, rl, self.reference, rl.micro_batch)
        self.version += 1
        return stats

    def evaluate(self) -> dict[str, Any]:
        """Held-out greedy accuracy and sampled pass@1 of the current policy."""
        return self._evaluate(self._engine_for(self.policy, self.tokenizer))

    def control(self, seconds: float) -> dict[str, Any]:
        """The control arm: the warm start's SFT continued for ``seconds``, then evaluated."""
        model, tokenizer, steps = continue_warm_start(self.config, self.env, self.warm, seconds)
        return {**self._evaluate(self._engine_for(model, tokenizer)), "sft_steps": steps}

    def close(self) -> None:
        """Stop the evaluation engine, if one runs in its own process."""
        if self._eval_engine is not None:
            self._eval_engine.close()
            self._eval_engine = None

    def _engine_for(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Engine:
        """An engine with ``model``'s weights, by ``inference.backend``: the torch engine wraps
        the model itself; one vLLM engine is kept and loads each model's weights in place."""
        if self.config.inference.backend == "torch":
            return TorchEngine(model, tokenizer, self.device)
        if self._eval_engine is None:
            self._eval_engine = policy_engine(self.config, model, tokenizer, self.device)
        else:
            self._eval_engine.load_state_dict(model.state_dict())
        return self._eval_engine

    def _evaluate(self, engine: Engine) -> dict[str, Any]:
        c = self.config
        return evaluate(
            self.env, engine, self.tokenizer, c.eval.n, c.eval.samples, c.rl.sampling, c.run.seed
        )
