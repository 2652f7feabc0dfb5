"""Two policy steps with a checkpoint between them, as one process or under torchrun.

    sharded_resume.py MODEL_DIR CKPT_DIR OUT.pt save   # step, checkpoint, step
    sharded_resume.py MODEL_DIR CKPT_DIR OUT.pt load   # resume from the checkpoint, step

Writes (from rank 0) the whole state dict after the second step and one draw of the RNG.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from sharded_step import ROWS, fixed_batch

from swarmrl.config import SwarmConfig
from swarmrl.model.io import load_policy
from swarmrl.rolekit.toolkit import end_process
from swarmrl.trainer.checkpoint import Checkpointer
from swarmrl.trainer.parallel import close_parallel, full_state_dict, init_parallel, shard
from swarmrl.trainer.step import make_optimizer, policy_step


def run(model_dir: str, ckpt_dir: str, out: str, mode: str) -> None:
    torch.manual_seed(0)
    config = SwarmConfig.model_validate({"rl": {"lr": 1e-3, "grad_clip": 0.1, "micro_batch": 2}})
    parallel = init_parallel("cpu", config.trainer, ROWS)
    model, _ = load_policy(Path(model_dir))
    shard(model, parallel, config.trainer)
    optimizer = make_optimizer(model, config.rl)
    checkpoints = Checkpointer(Path(ckpt_dir), config, parallel)
    batch = parallel.rows(fixed_batch(model.config.vocab_size))

    def step() -> None:
        policy_step(model, optimizer, batch, config.rl, None, 2, parallel.all_sum)

    if mode == "save":
        step()
        torch.manual_seed(1234)  # an RNG state the checkpoint must carry
        checkpoints.save(model, optimizer, 1, 1, {"where": "after step 1"})
    else:
        latest = checkpoints.latest()
        assert latest is not None
        resumed = checkpoints.load(latest, model, optimizer)
        assert (resumed.step, resumed.version) == (1, 1)
        if parallel.leader:
            assert resumed.source_state == {"where": "after step 1"}
    draw = torch.rand(3)
    step()
    state = full_state_dict(model, parallel)
    if parallel.leader:
        torch.save({"state": state, "draw": draw}, out)
    close_parallel(parallel)


if __name__ == "__main__":
    run(*sys.argv[1:5])
    # its work written and the process group closed, a rank ends at once, as a worker does
    # (swarmrl.rolekit.toolkit.end_process): a rank once aborted in the interpreter's
    # finalisation ("terminate called without an active exception"), failing the run
    end_process(0)
