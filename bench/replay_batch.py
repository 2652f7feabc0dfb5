"""Validator seconds per unit when claimed units are replayed together (``judge_many``).

    python bench/replay_batch.py [--units 32] [--batches 1 2 4 8] [--rounds 3]
        [--out bench/replay_batch.json]

On the demo's config (the embedded default) and its warm-started policy, an honest worker
(torch engine) generates ``--units`` real work units of the demo's shape
(``swarm.rollouts_per_lease`` samples: ``rl.group_size`` for each of the lease's tasks) with
their proofs. A validator (its own torch engine, the same weights) judges them ``b`` at a time
with ``swarmrl.roles.validator.judge.judge_many`` for each ``b`` of ``--batches``, the batch
sizes interleaved within each round. Reported per ``b``: seconds per unit judged (median and
range over the rounds), and its ratio to ``b = 1``, which is how the validator judged before
(one claimed submission at a time). Every unit must be accepted; a rejection stops the bench.

What a ratio means for the spot check (docs/toploc.md): a validator that replays ``r`` units per
unit submitted, ``b`` at a time, spends ``r × ratio(b)`` of what one replay per unit alone costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from losses import warm_start
from swarmrl.config import EMBEDDED_DEFAULT, load_config
from swarmrl.envs import build_env
from swarmrl.identity import KeyPair
from swarmrl.inference.engine import TorchEngine
from swarmrl.model.io import load_policy
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import WorkUnit
from swarmrl.protocol.verdicts import PendingSubmission
from swarmrl.rolekit.policy import LoadedVersion
from swarmrl.roles.validator.judge import judge_many
from swarmrl.roles.worker.rollouts import generate_unit
from swarmrl.toploc.bundle import build_bundles

DIGEST = "ab" * 32


def make_units(config, env, tokenizer, model, count: int) -> list[PendingSubmission]:
    """``count`` honest units of the demo's shape, each on its own tasks and seed."""
    worker = KeyPair.from_seed(bytes(32))
    engine = TorchEngine(model, tokenizer)
    group = config.rl.group_size
    tasks = max(1, config.swarm.rollouts_per_lease // group)

    def prove(generations, params):
        bundles = build_bundles(
            generations, keypair=worker, policy_version=0, model_digest=DIGEST, params=params
        )
        return [b.model_dump(mode="json") for b in bundles]

    units = []
    for n in range(count):
        work = WorkUnit(
            lease_id=f"l{n}", pool_id="bench", node_id=worker.node_id,
            task_indices=list(range(n * tasks, (n + 1) * tasks)), samples_per_task=group,
            sampling=SamplingParams(**config.rl.sampling.model_dump()), seed=1000 + n,
            min_version=0, deadline=1e12,
            origin_node_id=worker.node_id, origin_counter=n,
        )  # fmt: skip
        samples = generate_unit(engine, env, tokenizer, work, 0, prove)
        units.append(
            PendingSubmission(
                submission_id=f"s{n}",
                node_id=worker.node_id,
                node_key=worker.public_key_hex,
                request_signature="0" * 128,
                body_digest="0" * 64,
                request_timestamp_ms=0,
                request_nonce="0" * 32,
                work=work,
                samples=samples,
            )  # fmt: skip
        )
        print(f"  unit {n + 1}/{count} generated", end="\r", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return units


def time_batches(units, b: int, env, versions, toploc) -> float:
    """Seconds per unit judging ``units`` ``b`` at a time; every verdict must accept."""
    started = time.perf_counter()
    for i in range(0, len(units) - len(units) % b, b):
        for result in judge_many(units[i : i + b], env, versions, toploc):
            if result.verdict is None or not result.verdict.accept:
                raise SystemExit(f"an honest unit was not accepted: {result}")
    return (time.perf_counter() - started) / (len(units) - len(units) % b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default="bench/replay_batch.json")
    args = ap.parse_args()

    import torch

    config = load_config([EMBEDDED_DEFAULT], args.overrides)
    torch.set_num_threads(config.run.threads)
    env = build_env(config.env)
    path = warm_start(str(EMBEDDED_DEFAULT), args.overrides)
    model, tokenizer = load_policy(path, dtype=config.engine_dtype)
    units = make_units(config, env, tokenizer, model, args.units)
    validator, _ = load_policy(path, dtype=config.engine_dtype)
    loaded = LoadedVersion(0, DIGEST, TorchEngine(validator, tokenizer), tokenizer, Path("."))
    versions = {0: loaded}.__getitem__
    time_batches(units[:2], 1, env, versions, config.toploc)  # warm-up
    seconds: dict[int, list[float]] = {b: [] for b in args.batches}
    for r in range(args.rounds):
        order = args.batches if r % 2 == 0 else list(reversed(args.batches))
        for b in order:
            seconds[b].append(time_batches(units, b, env, versions, config.toploc))
            print(f"round {r + 1}: b={b} {seconds[b][-1] * 1e3:.1f} ms/unit", file=sys.stderr)
    base = statistics.median(seconds[min(args.batches)])
    rows = []
    for b in args.batches:
        s = seconds[b]
        rows.append(
            {
                "batch": b,
                "ms_per_unit": statistics.median(s) * 1e3,
                "ms_range": [min(s) * 1e3, max(s) * 1e3],
                "ratio": statistics.median(s) / base,
            }
        )
    shape = {
        "samples_per_unit": len(units[0].samples),
        "mean_output_tokens": statistics.mean(
            len(x.output_tokens) for u in units for x in u.samples
        ),
        "prompt_tokens": len(units[0].samples[0].prompt_tokens),
    }
    print("| units judged together | ms per unit, median (range) | ÷ one at a time |")
    print("|---|---|---|")
    for row in rows:
        lo, hi = row["ms_range"]
        print(
            f"| {row['batch']} | {row['ms_per_unit']:.1f} ({lo:.1f}–{hi:.1f}) "
            f"| {row['ratio']:.2f} |"
        )
    load = os.getloadavg()
    print(f"unit: {shape}; load {load[0]:.1f} {load[1]:.1f}")
    Path(args.out).write_text(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "units": args.units,
                "rounds": args.rounds,
                "threads": config.run.threads,
                "unit_shape": shape,
                "load": load,
                "rows": rows,
                "seconds": {str(b): s for b, s in seconds.items()},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
