"""Episodes on the swarm, timed: batched against one at a time, and validation against
generation.

On the shipped ``tool_arith`` config's warm start (``--config`` names another multi-turn
config, e.g. ``guess``) (trained once, or reused from
``run.cache_dir``), one unit of ``--tasks`` tasks × ``--group`` episodes, seeded as a worker's
lease would be:

- **generation, batched**: the worker's path (``swarmrl.roles.worker.rollouts.
  generate_episodes``), every unfinished episode advanced one turn per engine call, each call
  proven (hidden states kept, bundles built and signed);
- **generation, one at a time**: the same episodes (same seeds, hence the same tokens), each run
  alone with its own engine calls, proven the same way;
- **validation**: the validator's judgement of that unit (``swarmrl.roles.validator.judge``):
  every episode recomputed from its model turns, every model call replayed against the
  recomputed prompt (one batched prefill), sampling, termination and log-probs checked, the
  rewards scored.

The three run alternated, ``--repeat`` times, in one process on one thread. Printed: median
and range of each, episodes per second, and the ratios (batched ÷ one-at-a-time throughput;
generation ÷ validation time per episode, the issue's target being ≥ 5). ``--out`` gets every
repeat's figures as JSON. On the vLLM backend each repeat also reports the prompt positions
taken from vLLM's prefix cache (``inference.vllm.prefix_caching``; blocks of
``inference.vllm.block_size`` tokens), so a run with it on and one with it off compare the
same episodes.

    python bench/episodes.py --repeat 5 [--tasks 16 --group 8] [--set key=value ...]
    python bench/episodes.py --config guess --set inference.backend=vllm \
        --set inference.vllm.block_size=32 [--set inference.vllm.prefix_caching=false]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import swarmrl
from swarmrl.config import load_config

CONFIGS = Path(swarmrl.__file__).resolve().parent / "configs"
DIGEST = "ab" * 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tool_arith", help="a shipped config's name")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=Path("bench/episodes-results.json"))
    args = parser.parse_args()

    import torch

    from swarmrl.envs import build_env
    from swarmrl.identity import KeyPair
    from swarmrl.inference.interface import open_engine
    from swarmrl.model.io import load_tokenizer
    from swarmrl.protocol.pool import WorkUnit
    from swarmrl.protocol.seeds import sample_seed
    from swarmrl.protocol.verdicts import PendingSubmission
    from swarmrl.rolekit.policy import LoadedVersion
    from swarmrl.roles.validator.judge import judge
    from swarmrl.roles.worker.rollouts import generate_episodes
    from swarmrl.toploc.bundle import build_bundles
    from swarmrl.trainer.episodes import run_episodes
    from swarmrl.trainer.rollout import sampling_params
    from swarmrl.trainer.warmstart import ensure_warm_start

    torch.set_num_threads(1)
    config = load_config([CONFIGS / f"{args.config}.toml"], args.set)
    env = build_env(config.env)
    print("warm start (trained once, then cached) ...", flush=True)
    path = ensure_warm_start(config, env).path
    engine = open_engine(path, config.inference)
    tokenizer = load_tokenizer(path)
    worker = KeyPair.generate()
    loaded = LoadedVersion(0, DIGEST, engine, tokenizer, Path(path))
    sampling = sampling_params(config.rl.sampling, tokenizer)

    def prove(generations, params):
        bundles = build_bundles(
            generations,
            keypair=worker,
            policy_version=0,
            model_digest=DIGEST,
            params=params,
            chunk_size=config.toploc.chunk_size,
            topk=config.toploc.topk,
        )
        return [b.model_dump(mode="json") for b in bundles]

    def unit(seed: int, tasks: list[int]) -> WorkUnit:
        return WorkUnit(
            lease_id=f"l{seed}", pool_id="swarm", node_id=worker.node_id, task_indices=tasks,
            samples_per_task=args.group, sampling=sampling, seed=seed, min_version=0,
            deadline=1e12, origin_node_id=worker.node_id, origin_counter=seed,
        )  # fmt: skip

    runs = []
    for r in range(args.repeat):
        tasks = list(range(r * args.tasks, (r + 1) * args.tasks))
        work = unit(1000 + r, tasks)
        n = args.tasks * args.group
        cached = getattr(engine, "cached_positions", 0)
        start = time.perf_counter()
        batched = generate_episodes(engine, env, tokenizer, work, 0, prove)
        t_batched = time.perf_counter() - start
        cached = getattr(engine, "cached_positions", 0) - cached
        start = time.perf_counter()
        alone = []
        for i in range(n):  # episode i alone, with its own seed, proven the same way
            (state,) = run_episodes(
                env, engine, tokenizer, [env.task("train", tasks[i // args.group])],
                [sample_seed(work.seed, i)], sampling, on_turn=lambda b, g, p: prove(g, p),
            )  # fmt: skip
            alone.append([t for c in state.calls for t in c.output_tokens])
        t_alone = time.perf_counter() - start
        same = alone == [b.output_tokens for b in batched]
        pending = PendingSubmission(
            submission_id=f"s{r}", node_id=worker.node_id, node_key=worker.public_key_hex,
            request_signature="0" * 128, body_digest="0" * 64, request_timestamp_ms=0,
            request_nonce="0" * 32, work=work, samples=batched,
        )  # fmt: skip
        start = time.perf_counter()
        judgement = judge(pending, env, lambda v: loaded, config.toploc)
        t_judge = time.perf_counter() - start
        verdict = judgement.verdict
        calls = sum(len(s.episode.calls()) for s in batched)
        row = {
            "repeat": r,
            "episodes": n,
            "model_calls": calls,
            "model_tokens": sum(len(s.output_tokens) for s in batched),
            "positions": sum(len(c.prompt_tokens) for s in batched for c in s.episode.calls()),
            "cached_positions": cached,
            "batched_s": t_batched,
            "alone_s": t_alone,
            "validate_s": t_judge,
            "same_tokens": same,
            "accepted": bool(verdict is not None and verdict.accept),
            "mean_reward": statistics.fmean(judgement.rewards) if judgement.rewards else None,
        }
        runs.append(row)
        print(
            f"repeat {r}: {n} episodes ({calls} model calls): batched {t_batched:.2f} s, one at "
            f"a time {t_alone:.2f} s, validation {t_judge:.2f} s; same tokens: {same}; "
            f"accepted: {row['accepted']}; prompt positions from the prefix cache "
            f"{cached}/{row['positions']}",
            flush=True,
        )
    engine.close()  # vLLM's engine process, stopped before the interpreter exits
    _report(runs)
    args.out.write_text(json.dumps({"config": [args.config, *args.set], "runs": runs}, indent=1))
    print(f"figures in {args.out}")


def _report(runs: list[dict]) -> None:
    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3g} ({min(xs):.3g}–{max(xs):.3g})"

    speedup = [r["alone_s"] / r["batched_s"] for r in runs]
    ratio = [r["batched_s"] / r["validate_s"] for r in runs]
    per_ep = [r["batched_s"] / r["episodes"] * 1e3 for r in runs]
    per_val = [r["validate_s"] / r["episodes"] * 1e3 for r in runs]
    print()
    print("| measure | median (range) |")
    print("|---|---|")
    print(
        f"| episodes per second, batched | {med([r['episodes'] / r['batched_s'] for r in runs])} |"
    )
    print(
        f"| episodes per second, one at a time | {med([r['episodes'] / r['alone_s'] for r in runs])} |"
    )
    print(f"| batched ÷ one at a time (throughput) | {med(speedup)} |")
    print(f"| generation per episode, batched (ms) | {med(per_ep)} |")
    print(f"| validation per episode (ms) | {med(per_val)} |")
    print(f"| generation ÷ validation time | {med(ratio)} |")
    print(f"all the same tokens: {all(r['same_tokens'] for r in runs)}; all accepted: "
          f"{all(r['accepted'] for r in runs)}")  # fmt: skip


if __name__ == "__main__":
    main()
