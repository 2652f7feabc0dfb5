"""One policy step of a saved tiny model on a fixed batch, as one process or under torchrun.

    python sharded_step.py MODEL_DIR OUT.pt              # one process
    torchrun --nproc-per-node 2 sharded_step.py MODEL_DIR OUT.pt [ac|lora]

``ac``: with activation checkpointing; ``lora``: LoRA adapters (B factors set non-zero) on the
frozen base, the optimizer holding the adapters only.

Writes (from rank 0) the whole updated state dict and the step's numbers to OUT.pt.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import torch

from swarmrl.config import SwarmConfig
from swarmrl.model.io import load_policy
from swarmrl.rolekit.toolkit import end_process
from swarmrl.trainer.batch import TrainBatch
from swarmrl.trainer.lora import wrap
from swarmrl.trainer.parallel import close_parallel, full_state_dict, init_parallel, shard
from swarmrl.trainer.step import make_optimizer, policy_step

ROWS, WIDTH = 5, 12  # odd rows: the second rank's slice is padded


def fixed_batch(vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (ROWS, WIDTH), generator=g)
    mask = torch.zeros(ROWS, WIDTH - 1)
    for i in range(ROWS):
        mask[i, 3 : 3 + 2 + i] = 1.0  # outputs of different lengths
    behaviour = -torch.rand(ROWS, WIDTH - 1, generator=g) * 3 * mask
    adv = torch.tensor([[1.0], [-0.5], [0.25], [-1.0], [0.75]])
    return TrainBatch(ids, mask, behaviour, adv)


def run_step(model_dir: str, out: str, recompute: bool = False, lora: bool = False) -> None:
    torch.manual_seed(0)
    config = SwarmConfig.model_validate(
        {
            "rl": {"lr": 1e-3, "grad_clip": 0.1, "micro_batch": 2},
            "trainer": {"activation_checkpointing": recompute},
            "model": {"lora": {"enabled": lora, "rank": 4}},
        }
    )
    parallel = init_parallel("cpu", config.trainer, ROWS)
    model, _ = load_policy(Path(model_dir))
    if lora:
        model = wrap(model, config.model.lora)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # non-zero, so A gets a gradient too
                    p.copy_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape))
    shard(model, parallel, config.trainer)
    optimizer = make_optimizer(model, config.rl)
    batch = parallel.rows(fixed_batch(model.config.vocab_size))
    stats = policy_step(
        model, optimizer, batch, config.rl, None, config.rl.micro_batch, parallel.all_sum
    )
    state = full_state_dict(model, parallel)
    if parallel.leader:
        torch.save({"state": state, "stats": asdict(stats), "world": parallel.world}, out)
    close_parallel(parallel)


if __name__ == "__main__":
    run_step(sys.argv[1], sys.argv[2], sys.argv[3:] == ["ac"], sys.argv[3:] == ["lora"])
    # its work written and the process group closed, a rank ends at once, as a worker does
    # (swarmrl.rolekit.toolkit.end_process): a rank once aborted in the interpreter's
    # finalisation ("terminate called without an active exception"), failing the run
    end_process(0)
