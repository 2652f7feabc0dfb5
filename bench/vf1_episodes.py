"""Benchmark: verifiers 0.4 harness episodes (``swarmrl.envs.vf1``) answered by the token
endpoint one engine call at a time against batched across the episodes in flight.

Both arms play the same episodes (the ``swarmrl_vf1_sums`` taskset of ``swarmrl.testing.vf1``,
its harness in ``check`` mode: two model calls per episode with an environment turn between them,
every harness program a subprocess talking to verifiers' interception) on the same random tiny
model; they differ only in the endpoint's ``max_batch`` (1: one row per engine call; 64: every
request waiting when the engine frees up goes into its next call). The arms alternate
(A, B, A, B …) in one process; each reports episodes per second (median and range over runs),
and the two arms' episodes are checked to carry the same tokens.

``--replay`` adds the trusted side's arm: the batched arm's episodes played again by the harness
with their model turns scripted (``swarmrl.trainer.harness_check.rerun_episodes``, what a
validator and the trainer do under ``env.verifiers_reexecute``), timed the same way, and checked
to replay without a rejection. Its rate against the batched arm's is what the harness replay
costs next to generating the episodes (the proofs' and sampling's replay of the model calls
comes on top, as for any episode).

    python bench/vf1_episodes.py                        # 16 episodes, 3 runs per arm
    python bench/vf1_episodes.py --episodes 32 --hidden 512 --layers 4 --runs 5
    python bench/vf1_episodes.py --replay

Needs verifiers>=0.4 (``pip install 'swarmrl[tasks]'``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from swarmrl.envs.vf1 import VerifiersV1Env
from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.token_endpoint import serve_engine
from swarmrl.protocol import SamplingParams
from swarmrl.testing.vf1 import char_policy, write_taskset
from swarmrl.trainer.harness_check import rerun_episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3, help="runs per arm")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--replay", action="store_true", help="time the trusted side's replay")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="vf1-bench-"))
    (root / "taskset").mkdir()
    (root / "policy").mkdir()
    taskset = write_taskset(root / "taskset")
    path, tokenizer, model = char_policy(root / "policy", args.hidden, args.layers)
    engine = TorchEngine(model, tokenizer)
    env = VerifiersV1Env(taskset, harness_args={"mode": "check"}, timeout_s=600)
    train = env.first("train", env.split_size("train"))
    tasks = [train[i % len(train)] for i in range(args.episodes)]
    seeds = list(range(1000, 1000 + args.episodes))
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)

    arms = {"one_at_a_time": 1, "batched": 64}
    rates: dict[str, list[float]] = {name: [] for name in arms}
    tokens: dict[str, list] = {}
    for _ in range(args.runs):
        for name, max_batch in arms.items():
            with serve_engine(engine, params, max_batch=max_batch) as endpoint:
                start = time.perf_counter()
                played = env.run_episodes(tasks, seeds, endpoint, path, params)
                elapsed = time.perf_counter() - start
            rates[name].append(args.episodes / elapsed)
            tokens[name] = [[s.tokens for s in p.episode.segments] for p in played]
        if args.replay:
            start = time.perf_counter()
            reruns = rerun_episodes(env, tokenizer, tasks, [p.episode for p in played], params)
            rates.setdefault("replay", []).append(args.episodes / (time.perf_counter() - start))
            rejected = [r.rejection or r.own_failure for r in reruns if not r.calls]
            assert not rejected, rejected
    same = tokens["one_at_a_time"] == tokens["batched"]
    load = os.getloadavg()
    print(
        f"{args.episodes} episodes x {args.runs} runs per arm, model hidden {args.hidden} x "
        f"{args.layers} layers, {args.max_new_tokens} new tokens per call; "
        f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {os.cpu_count()} CPUs"
    )
    for name, values in rates.items():
        print(
            f"{name:>14}: {statistics.median(values):6.2f} episodes/s "
            f"(range {min(values):.2f}-{max(values):.2f})"
        )
    ratio = statistics.median(rates["batched"]) / statistics.median(rates["one_at_a_time"])
    print(f"batched / one at a time: {ratio:.2f}x; same tokens in both arms: {same}")
    if args.replay:
        replay = statistics.median(rates["replay"]) / statistics.median(rates["batched"])
        print(f"replay / batched generation: {replay:.2f}x the episodes per second")


if __name__ == "__main__":
    main()
