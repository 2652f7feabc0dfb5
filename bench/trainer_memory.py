"""Trainer memory per rank: parameters, gradients and AdamW state held by each rank after one
policy step, as one process or under torchrun with FSDP2.

    python bench/trainer_memory.py                                  # one process
    torchrun --standalone --nproc-per-node 2 bench/trainer_memory.py

The model is a random-init Llama of ~113M parameters (hidden 768, 12 layers, MLP 3072) over a
small vocabulary; the batch is 4 rows of 32 tokens. Bytes are counted from the tensors each
rank holds (a shard's local part under FSDP2); peak RSS is the process's ``ru_maxrss``. Each
rank prints one JSON line.
"""

from __future__ import annotations

import json
import resource
import time

import torch

from swarmrl.config import SwarmConfig
from swarmrl.config.model import TinyModelConfig
from swarmrl.model.factory import create_tiny_model
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.trainer.batch import TrainBatch
from swarmrl.trainer.parallel import close_parallel, init_parallel, shard
from swarmrl.trainer.step import make_optimizer, policy_step

SHAPE = TinyModelConfig(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)
ROWS, WIDTH = 4, 32


def local_bytes(tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = SwarmConfig.model_validate({"rl": {"micro_batch": 4}})
    parallel = init_parallel("cpu", config.trainer, ROWS)
    tokenizer = build_char_tokenizer("0123456789+-= ")
    model = create_tiny_model(SHAPE, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    shard(model, parallel, config.trainer)
    optimizer = make_optimizer(model, config.rl)
    g = torch.Generator().manual_seed(1)
    batch = TrainBatch(
        torch.randint(3, len(tokenizer), (ROWS, WIDTH), generator=g),
        torch.ones(ROWS, WIDTH - 1),
        -torch.rand(ROWS, WIDTH - 1, generator=g),
        torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]),
    )
    began = time.perf_counter()
    policy_step(model, optimizer, parallel.rows(batch), config.rl, None, 4, parallel.all_sum)
    seconds = time.perf_counter() - began
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    row = {
        "rank": parallel.rank,
        "world": parallel.world,
        "model_params": n_params,
        "param_bytes": local_bytes(params),
        "grad_bytes": local_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer_bytes": local_bytes(state),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": round(seconds, 2),
    }
    print(json.dumps(row), flush=True)
    close_parallel(parallel)


if __name__ == "__main__":
    main()
