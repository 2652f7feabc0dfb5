"""One FSDP2 + bf16 optimizer step of a Qwen2.5-0.5B-shaped random-init model on GPU(s).

    torchrun --standalone --nproc-per-node 1 bench/gpu/fsdp_step.py [--lora] [--steps 3]

Builds a Qwen2 model with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads,
MLP 4864, vocabulary 151936, tied embeddings; random init: no download), shards it with the
trainer's FSDP2 setup (:func:`swarmrl.trainer.parallel.apply_fsdp`: every decoder layer, then
the model; bf16 parameters for compute, fp32 gradient reduction), and runs ``--steps`` policy
steps of :func:`swarmrl.trainer.step.policy_step` on a batch of 16 rows × 1024 tokens. Prints
one JSON line per rank: seconds per step (the first, which includes warm-up, and the median of
the rest) and peak CUDA memory. ``--lora`` trains rank-16 adapters on the attention projections
instead (needs ``peft``).

Needs a CUDA GPU; not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from swarmrl.config import SwarmConfig
from swarmrl.trainer.batch import TrainBatch
from swarmrl.trainer.parallel import Parallel, apply_fsdp
from swarmrl.trainer.step import make_optimizer, policy_step

SHAPE = dict(
    vocab_size=151936,
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
ROWS, WIDTH = 16, 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    parallel = Parallel(dist.get_rank(), dist.get_world_size(), f"cuda:{local}")
    torch.manual_seed(0)
    with torch.device(parallel.device):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE))
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
        )
    apply_fsdp(model, on_gpu=True)
    config = SwarmConfig.model_validate({"rl": {"micro_batch": 4, "logprob_chunk": 256}})
    optimizer = make_optimizer(model, config.rl)
    g = torch.Generator().manual_seed(1)
    batch = TrainBatch(
        torch.randint(0, SHAPE["vocab_size"], (ROWS, WIDTH), generator=g),
        torch.cat([torch.zeros(ROWS, WIDTH // 4), torch.ones(ROWS, WIDTH - 1 - WIDTH // 4)], 1),
        -torch.rand(ROWS, WIDTH - 1, generator=g),
        torch.linspace(-1, 1, ROWS).reshape(ROWS, 1),
    )
    mine = parallel.rows(batch).to(parallel.device)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        stats = policy_step(
            model, optimizer, mine, config.rl, None, config.rl.micro_batch, parallel.all_sum
        )
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    row = {
        "rank": parallel.rank,
        "world": parallel.world,
        "lora": args.lora,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "first_step_s": round(times[0], 3),
        "step_s_median": round(statistics.median(times[1:] or times), 3),
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(),
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
    }
    print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
