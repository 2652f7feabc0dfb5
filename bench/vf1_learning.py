"""A verifiers 0.4 taskset learned through ``swarmrl run --colocated``: the reward rises.

    python bench/vf1_learning.py [--steps 60] [--seeds 0 1] [--lr 2e-3] [--out bench/vf1_learning.json]

The tests' taskset and harness (``swarmrl.testing.vf1``: sums, the ``check`` harness that asks
"sure?" after the first answer, so every episode has two model calls and an environment turn
between them) with its dense reward (the share of the last reply's characters that are
digits), a random one-layer policy, ``--steps`` steps of 8 tasks × 4 episodes. Each seed is one
``swarmrl run CONFIG --colocated`` process; its ``metrics.jsonl`` and ``report.json`` are read
back. Printed per seed: the mean reward of the first and the last 5 steps, and held-out
(2 tasks, 8 sampled episodes each) pass@1 before and after (reward 1 = an all-digit reply);
the curves go to ``--out`` and a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from swarmrl.testing.vf1 import write_run


def one_run(root: Path, steps: int, lr: float, seed: int) -> dict:
    config, env = write_run(
        root, steps=steps, prompts=8, group=4, lr=lr, eval_every=0, eval_samples=8, seed=seed
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", "run", str(config), "--colocated", "--quiet"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: the run failed:\n{done.stderr[-3000:]}")
    [run_dir] = (root / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if "loss" in r]
    evaluation = json.loads((run_dir / "report.json").read_text())["eval"]
    return {
        "seed": seed,
        "seconds": time.monotonic() - started,
        "rewards": rewards,
        "first5": statistics.mean(rewards[:5]),
        "last5": statistics.mean(rewards[-5:]),
        "heldout_before": evaluation["before"],
        "heldout_after": evaluation["after"],
    }


def plot(runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        ax.plot(range(len(run["rewards"])), run["rewards"], label=f"seed {run['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (share of digits in the last reply)")
    ax.set_title("verifiers 0.4 taskset, harness episodes, swarmrl run --colocated")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", type=Path, default=Path("bench/vf1_learning.json"))
    args = ap.parse_args()
    runs = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as scratch:
            print(f"seed {seed}: {args.steps} steps ...", file=sys.stderr, flush=True)
            run = one_run(Path(scratch), args.steps, args.lr, seed)
        runs.append(run)
        print(
            f"seed {seed}: reward {run['first5']:.2f} (first 5 steps) -> {run['last5']:.2f} "
            f"(last 5); held-out pass@1 {run['heldout_before']['pass_at_1']:.2f} -> "
            f"{run['heldout_after']['pass_at_1']:.2f}; {run['seconds']:.0f} s"
        )
    load = os.getloadavg()
    print(f"load {load[0]:.1f} {load[1]:.1f}")
    args.out.write_text(
        json.dumps({"command": " ".join(sys.argv), "load": load, "runs": runs}, indent=1)
    )
    plot(runs, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
