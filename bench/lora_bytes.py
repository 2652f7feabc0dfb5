"""Bytes on the wire per policy version: full weights, today's delta encoding, LoRA adapters.

    python bench/lora_bytes.py --model demo     # the demo's ~1.05M Llama (configs/arith.toml)
    python bench/lora_bytes.py --model 100m     # ~113M Llama (hidden 768, 12 layers, MLP 3072)

Two arms train the same random-init model for ``--versions`` policy steps on one fixed random
batch and publish every version through a real shardcast publisher, origin and client:

* full: every weight trains (AdamW, lr ``--lr-full``, the demo's rl.lr); each version is the
  whole checkpoint, sent as a delta from the parent where that is smaller (shardcast's default:
  XOR byte planes + zstd, a keyframe every ``keyframe_interval`` versions);
* lora: adapters (rank ``--rank``, every projection) on the frozen base (AdamW, lr
  ``--lr-lora``); each version is the base (same bytes every version) plus the adapter.

For each version after the first, the client's ``network_bytes`` (what it downloaded holding
the parent) is recorded next to the version's full size. Prints one JSON line per arm with the
median and range over versions.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
from pathlib import Path

import torch

from swarmrl.config import SwarmConfig
from swarmrl.config.model import LoraConfig, TinyModelConfig
from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.identity import KeyPair
from swarmrl.inference.lora import adapter_tensors
from swarmrl.model.factory import create_tiny_model
from swarmrl.model.io import save_policy
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.shardcast import Publisher, WeightClient
from swarmrl.testing.shardcast import serve_store
from swarmrl.trainer.batch import TrainBatch
from swarmrl.trainer.lora import AdapterVersions, wrap
from swarmrl.trainer.step import make_optimizer, policy_step

SHAPES = {
    "demo": TinyModelConfig(initializer_range=0.1),  # configs/arith.toml's model
    "100m": TinyModelConfig(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072),
}
ROWS, WIDTH = 8, 32


def batch(vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    return TrainBatch(
        torch.randint(3, vocab, (ROWS, WIDTH), generator=g),
        torch.ones(ROWS, WIDTH - 1),
        -torch.rand(ROWS, WIDTH - 1, generator=g),
        torch.linspace(-1, 1, ROWS)[:, None],
    )


def run_arm(arm: str, args: argparse.Namespace, work: Path) -> dict[str, object]:
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer("0123456789+-= ")
    base = create_tiny_model(SHAPES[args.model], tokenizer)
    lr = args.lr_full if arm == "full" else args.lr_lora
    config = SwarmConfig.model_validate({"rl": {"lr": lr, "micro_batch": ROWS}})
    lora = LoraConfig(enabled=True, rank=args.rank, alpha=2.0 * args.rank)
    versions = AdapterVersions(base, tokenizer, lora) if arm == "lora" else None
    model = wrap(copy.deepcopy(base), lora) if arm == "lora" else base
    optimizer = make_optimizer(model, config.rl)
    data = batch(len(tokenizer))
    cast = ShardcastConfig()
    publisher = Publisher(work / arm / "origin", KeyPair.from_seed(b"\x05" * 32), cast)
    origin = serve_store(work / arm / "origin", cast)
    client = WeightClient(
        [origin.url], publisher.keypair.public_key_hex, work / arm / "client", cast
    )
    sizes: list[int] = []
    wire: list[int] = []
    try:
        for v in range(args.versions + 1):  # a worker fetches each version as it appears
            if v > 0:
                policy_step(model, optimizer, data, config.rl, None, ROWS)
            out = work / arm / f"ck{v}"
            if versions is not None:
                adapter = adapter_tensors(model.state_dict())
                versions.save(adapter, model.peft_config["default"], out)
            else:
                save_policy(model, tokenizer, out)
            sizes.append(publisher.publish(out, v).total_bytes)
            client.wait_for_newer(than=v - 1, timeout_s=60)  # the origin has noticed it
            client.fetch(v)
            wire.append(client.last_report.network_bytes)
    finally:
        client.close()
        origin.stop()
        if versions is not None:
            versions.close()
    after = wire[1:]
    return {
        "model": args.model,
        "arm": arm,
        "params": sum(p.numel() for p in base.parameters()),
        "lr": lr,
        "version_bytes": sizes[-1],
        "first_fetch_bytes": wire[0],
        "wire_bytes_per_version_median": statistics.median(after),
        "wire_bytes_per_version_range": [min(after), max(after)],
        "wire_bytes": wire,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="demo")
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr-full", type=float, default=3e-4)
    parser.add_argument("--lr-lora", type=float, default=3e-3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="lora-bytes-") as tmp:
        for arm in ("full", "lora"):
            print(json.dumps(run_arm(arm, args, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
