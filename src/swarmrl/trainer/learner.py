"""The policy being trained and everything that touches its weights, the same in every mode.

A :class:`Learner` holds the policy (started from the cached warm start or ``model.path``), its
optimizer, the frozen reference policy when the loss has a KL term, and the policy version (the
number of optimizer steps taken). It takes one RL step on scored groups (begun, where the
batch arrives in parts, with the gradients of its first groups: :class:`EarlyStep`),
evaluates the current policy on held-out tasks, and runs the control arm (the warm start's SFT
continued for a given wall time).

Under torchrun (:mod:`swarmrl.trainer.parallel`) every rank holds a :class:`Learner`: ``trained``
is its FSDP2-sharded policy, and the leader also keeps ``policy``, a whole copy refreshed after
every step (what is evaluated, published and loaded into engines). The other ranks evaluate
nothing. As one process ``policy`` and ``trained`` are the same module.

With ``[model.lora]`` (:mod:`swarmrl.trainer.lora`) ``trained`` is the policy inside peft
adapters, base frozen, and ``policy`` stays a plain model holding the merged weights (refreshed
after every step, in every mode); a published version is the base plus the adapter.

Knows nothing about where rollouts come from or where new versions go (that is the rollout
source's business, :mod:`swarmrl.trainer.source`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.config import SwarmConfig
from swarmrl.envs import Environment
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.interface import Engine
from swarmrl.inference.lora import adapter_tensors, merge_peft_state
from swarmrl.model.io import save_policy
from swarmrl.model.prompts import check_prompts_encodable
from swarmrl.trainer.batch import Group, TrainBatch, collate
from swarmrl.trainer.checkpoint import Checkpointer, Resumed
from swarmrl.trainer.engines import policy_engine
from swarmrl.trainer.evaluate import evaluate
from swarmrl.trainer.lora import AdapterVersions, check_lora, scaling, wrap
from swarmrl.trainer.parallel import Parallel, full_state_dict, shard
from swarmrl.trainer.step import StepAccumulator, StepStats, make_optimizer
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


class EarlyStep:
    """A step whose batch is still arriving: :meth:`feed` computes the gradients of the next
    groups of it at once, so a trainer waiting for the rest of a batch is not idle while part
    of it is there (:meth:`Learner.begin_step`)."""

    def __init__(
        self, accumulator: StepAccumulator, rows: Callable[[list[Group]], TrainBatch]
    ) -> None:
        self.accumulator, self._rows = accumulator, rows
        self.fed = 0  # leading groups of the batch fed so far
        self.busy_s = 0.0  # seconds spent computing them

    def feed(self, groups: list[Group]) -> None:
        """The batch's next ``groups``, in order (the step trains on them whatever comes next)."""
        if not groups:
            return
        began = time.monotonic()
        self.accumulator.add(self._rows(groups))
        self.fed += len(groups)
        self.busy_s += time.monotonic() - began


PROMPT_CHECKS = 64  # training prompts whose encoding is checked at start


class Learner:
    """The policy, its optimizer and version; one RL step; held-out evaluation; the control."""

    def __init__(
        self,
        config: SwarmConfig,
        env: Environment,
        on_sft_step: Callable[[int, float], None] | None = None,
        parallel: Parallel | None = None,
    ) -> None:
        self.config, self.env = config, env
        check_lora(config)  # before the warm start: peft missing or a bad target is one line
        self.parallel = parallel or Parallel(device=resolve_device(config.run.device))
        self.device = self.parallel.device
        if self.parallel.leader:  # the leader trains the warm start; the others then load it
            self.warm: WarmStart = ensure_warm_start(config, env, on_step=on_sft_step)
        self.parallel.barrier()
        if not self.parallel.leader:
            self.warm = ensure_warm_start(config, env)
        self.policy: PreTrainedModel
        self.tokenizer: PreTrainedTokenizerBase
        self.policy, self.tokenizer = load_start_policy(config, self.warm, self.device)
        check_prompts_encodable(
            self.tokenizer, [*env.first("train", PROMPT_CHECKS), *env.first("heldout", 8)]
        )
        self.reference = (
            copy.deepcopy(self.policy).eval() if config.rl.wants_reference else None
        )  # frozen π_ref of the KL term
        lora = config.model.lora if config.model.lora.enabled else None
        self.lora = lora
        separate = self.parallel.sharded or lora is not None  # `policy` is not what is trained
        self.trained = (
            copy.deepcopy(self.policy) if separate and self.parallel.leader else self.policy
        )
        self.versions: AdapterVersions | None = None
        self.adapter: dict[str, torch.Tensor] = {}  # the leader's adapter tensors (LoRA only)
        if lora is not None:
            if self.parallel.leader:
                self.versions = AdapterVersions(self.policy, self.tokenizer, lora)
            self.trained = wrap(self.trained, lora)
            self.peft_config = self.trained.peft_config["default"]
        shard(self.trained, self.parallel, config.trainer)
        if self.reference is not None:
            shard(self.reference, self.parallel, config.trainer)
        torch.manual_seed(config.run.seed)
        self.optimizer = make_optimizer(self.trained, config.rl)
        self.version = 0  # optimizer steps taken (a resumed run may skip published numbers)
        self.first_step = 0  # the loop's first step: > 0 when resumed from a checkpoint
        self._eval_engine: Engine | None = None  # vLLM only: started once, reloaded per eval
        if lora is not None:
            self.refresh_policy()  # the adapter of version 0 (B = 0: the base itself)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else 0

    def begin_step(self) -> EarlyStep | None:
        """The next step, to be fed the leading groups of its batch while the rest is still
        coming (their gradients computed at once); None where ranks split every batch, which
        they take whole and together."""
        if self.parallel.sharded:
            return None
        return EarlyStep(self._accumulator(), self._rows)

    def step(self, groups: list[Group], early: EarlyStep | None = None) -> StepStats:
        """One optimizer step on ``groups``; the ratio is against their behaviour log-probs.
        ``early``: the step begun with :meth:`begin_step`, fed a leading part of ``groups``."""
        step = early or EarlyStep(self._accumulator(), self._rows)
        step.feed(groups[step.fed :])
        stats = step.accumulator.finish(self.parallel.all_sum)
        self.version += 1
        self.refresh_policy()
        return stats

    def _accumulator(self) -> StepAccumulator:
        rl = self.config.rl
        return StepAccumulator(self.trained, self.optimizer, rl, self.reference, rl.micro_batch)

    def _rows(self, groups: list[Group]) -> TrainBatch:
        """This rank's rows of ``groups``, on the device."""
        batch = collate(groups, self.pad_id, self.config.rl.advantage_mode, self.version)
        return self.parallel.rows(batch).to(self.device)

    def save_checkpoint(self, checkpointer: Checkpointer, step: int, source_state: Any) -> None:
        """Checkpoint after ``step`` loop steps (collective: every rank calls it)."""
        checkpointer.save(self.trained, self.optimizer, step, self.version, source_state)

    def resume(self, checkpointer: Checkpointer, path: Path) -> Resumed:
        """Load checkpoint ``path``: weights, optimizer, RNG, version, next step. Collective."""
        resumed = checkpointer.load(path, self.trained, self.optimizer)
        self.version, self.first_step = resumed.version, resumed.step
        self.refresh_policy()
        return resumed

    def refresh_policy(self) -> None:
        """Copy the sharded weights (with LoRA: the merged weights) into the leader's whole
        ``policy``; keep the adapter's tensors for publishing. Collective."""
        if not (self.parallel.sharded or self.lora is not None):
            return
        state = full_state_dict(self.trained, self.parallel)
        if not self.parallel.leader:
            return
        if self.lora is not None:
            self.adapter = {k: v.clone() for k, v in adapter_tensors(state).items()}
            state = merge_peft_state(state, scaling(self.lora))
        self.policy.load_state_dict(state)

    def save_version(self, out: Path) -> Path:
        """Write the current policy as a version directory ``out`` (leader only): the whole
        checkpoint, or with LoRA the base plus the adapter (:mod:`swarmrl.trainer.lora`)."""
        if self.versions is None:
            return save_policy(self.policy, self.tokenizer, out)
        return self.version_writer()(out)

    def version_writer(self) -> Callable[[Path], Path]:
        """LoRA: a writer of the current version (base + this adapter) that later steps do not
        change (each refresh replaces ``adapter`` rather than modifying it). Leader only."""
        versions, adapter, spec = self.versions, self.adapter, self.peft_config
        if versions is None:
            raise ValueError("version_writer is for LoRA policies; use save_version")
        return lambda out: versions.save(adapter, spec, out)

    def evaluate(self) -> dict[str, Any]:
        """Held-out greedy accuracy and sampled pass@1 of the current policy (leader only)."""
        if not self.parallel.leader:
            return {}
        return self._evaluate(self._engine_for(self.policy, self.tokenizer))

    def control(self, seconds: float) -> dict[str, Any]:
        """The control arm: the warm start's SFT continued for ``seconds``, then evaluated."""
        if not self.parallel.leader:
            return {}
        model, tokenizer, steps = continue_warm_start(self.config, self.env, self.warm, seconds)
        return {**self._evaluate(self._engine_for(model, tokenizer)), "sft_steps": steps}

    def close(self) -> None:
        """Stop the evaluation engine, if one runs in its own process."""
        if self._eval_engine is not None:
            self._eval_engine.close()
            self._eval_engine = None
        if self.versions is not None:
            self.versions.close()
            self.versions = None

    def _engine_for(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Engine:
        """An engine with ``model``'s weights, by ``inference.backend``: the torch engine wraps
        the model itself; one vLLM engine is kept and loads each model's weights in place."""
        if self.config.inference.backend == "torch":
            return TorchEngine(model, tokenizer, self.device)
        if self._eval_engine is None:
            self._eval_engine = policy_engine(
                self.config, model, tokenizer, self.device, dtype=self.config.model.dtype
            )
        else:
            self._eval_engine.load_state_dict(model.state_dict())
        return self._eval_engine

    def _evaluate(self, engine: Engine) -> dict[str, Any]:
        c = self.config
        return evaluate(
            self.env, engine, self.tokenizer, c.eval.n, c.eval.samples, c.rl.sampling, c.run.seed
        )
