"""Data parallelism of the trainer: the torchrun process group, FSDP2 sharding, batch split.

Under ``torchrun --nproc-per-node N`` (``WORLD_SIZE`` > 1 in the environment) every rank runs
the same training loop in lockstep. Rank 0 (the leader) alone talks to the rollout source; it
broadcasts each step's groups to the others (:class:`LeaderSource`, :class:`FollowerSource`).
Every rank collates the same batch and trains on its own contiguous slice of rows
(:meth:`Parallel.rows`, padded with zero-mask rows so each rank runs the same number of
micro-batches); gradients are *summed* across ranks (the loss is already divided by the token
count of the whole batch, all-reduced by :func:`swarmrl.trainer.step.policy_step`).

Sharding (:func:`shard`): ``fully_shard`` on each decoder layer, then on the model; on GPU
parameters are gathered in bf16 and gradients reduced in fp32 (``MixedPrecisionPolicy``);
activation checkpointing optional. As one process, nothing here does anything.

Knows nothing about the loss, rollouts' contents or where versions are published.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import PreTrainedModel

from swarmrl.config.trainer import TrainerConfig
from swarmrl.errors import ConfigError, RankAborted
from swarmrl.trainer.batch import TrainBatch
from swarmrl.trainer.source import Feed, RolloutSource, StepRollouts


@dataclass(frozen=True)
class Parallel:
    """This process's place among the trainer's ranks (``world == 1``: a single process)."""

    rank: int = 0
    world: int = 1
    device: str = "cpu"

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over ranks (float64 on the wire, so counts stay exact)."""
        if not self.sharded:
            return values
        total = values.detach().to(self.device, torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.to(values.device, values.dtype)

    def broadcast(self, obj: Any) -> Any:
        """The leader's ``obj`` on every rank (the others pass anything)."""
        if not self.sharded:
            return obj
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()

    def rows(self, batch: TrainBatch) -> TrainBatch:
        """This rank's contiguous ⌈B/N⌉ rows of ``batch``, zero-mask padded to that size."""
        if not self.sharded:
            return batch
        size = -(-batch.input_ids.shape[0] // self.world)
        part = batch.rows(self.rank * size, (self.rank + 1) * size)
        missing = size - part.input_ids.shape[0]
        if missing == 0:
            return part
        return TrainBatch(
            _pad_rows(part.input_ids, missing),
            _pad_rows(part.loss_mask, missing),
            _pad_rows(part.behaviour_logp, missing),
            _pad_rows(part.advantages, missing),
            None if part.age is None else _pad_rows(part.age, missing),
        )


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    # padded rows: token 0, mask 0, so they add nothing to any sum
    return torch.cat([t, t.new_zeros((n, *t.shape[1:]))])


def init_parallel(device: str, trainer: TrainerConfig, batch_rows: int) -> Parallel:
    """The process group torchrun describes in the environment (a single process when none).

    ``device`` is ``"cpu"`` or ``"cuda"``; under torchrun on GPU each rank takes
    ``cuda:LOCAL_RANK``. Raises :class:`ConfigError` when there are more ranks than rows.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > batch_rows:
        raise ConfigError(
            f"trainer.nproc: {world} ranks but a step's batch has only {batch_rows} rows "
            f"(rl.prompts_per_step × rl.group_size); use at most {batch_rows} ranks"
        )
    if world == 1:
        return Parallel(device=device)
    rank = int(os.environ["RANK"])
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=trainer.rank_timeout_s))
    return Parallel(rank=rank, world=world, device=device)


def close_parallel(parallel: Parallel) -> None:
    if parallel.sharded and dist.is_initialized():
        dist.destroy_process_group()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a HF causal LM (``model.model.layers``; through a peft wrapper
    too)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return list(layers)
    raise ConfigError(f"model: cannot find the decoder layers of {type(model).__name__}")


def shard(model: PreTrainedModel, parallel: Parallel, trainer: TrainerConfig) -> PreTrainedModel:
    """Apply activation checkpointing (if asked) and FSDP2 to ``model`` in place; return it."""
    if trainer.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if parallel.sharded:
        apply_fsdp(model, on_gpu=parallel.device.startswith("cuda"))
    return model


def apply_fsdp(model: torch.nn.Module, on_gpu: bool) -> None:
    """FSDP2 on every decoder layer, then on the model, over the default process group; on GPU
    bf16 parameters for compute and fp32 gradient reduction."""
    policy = MixedPrecisionPolicy()
    if on_gpu:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # the loss is divided by the global token count already: sum, do not average
            # (a plain SUM, which gloo supports, rather than a pre-multiplied one)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def full_state_dict(model: torch.nn.Module, parallel: Parallel) -> dict[str, torch.Tensor]:
    """The whole unsharded state dict, on CPU, on the leader (empty elsewhere). Collective."""
    if not parallel.sharded:
        return model.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


@dataclass
class _Abort:
    """What the leader broadcasts instead of a batch when it cannot go on."""

    reason: str


class LeaderSource:
    """Rank 0's source: the real one, each step's groups broadcast to the other ranks."""

    def __init__(self, inner: RolloutSource, parallel: Parallel) -> None:
        self.inner, self.parallel = inner, parallel

    def next_batch(self, step: int, policy_version: int, early: Feed | None = None) -> StepRollouts:
        try:
            rollouts = self.inner.next_batch(step, policy_version, early)
        except BaseException as exc:
            self.parallel.broadcast(_Abort(f"{type(exc).__name__}: {exc}"))
            raise
        self.parallel.broadcast(rollouts.groups)
        return rollouts

    def commit(self, step: int, policy_version: int) -> None:
        self.inner.commit(step, policy_version)


class FollowerSource:
    """Another rank's source: the groups the leader broadcasts for each step."""

    def __init__(self, parallel: Parallel) -> None:
        self.parallel = parallel

    def next_batch(self, step: int, policy_version: int, early: Feed | None = None) -> StepRollouts:
        groups = self.parallel.broadcast(None)  # whole: ranks never begin a step early
        if isinstance(groups, _Abort):
            raise RankAborted(
                f"rank {self.parallel.rank}: rank 0 stopped at step {step}: {groups.reason}"
            )
        return StepRollouts(groups=groups)

    def commit(self, step: int, policy_version: int) -> None:
        pass
