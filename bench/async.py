"""Asynchrony benchmark: a local swarm at async_level 0 and 2, and the colocated loop.

One run of each arm on the same config and the same warm start (``model.path`` pinned, so no
arm pays for SFT). Per arm: wall-clock per RL step, the trainer's idle fraction (time spent
waiting for accepted rollouts / RL time), held-out greedy accuracy after the same number of
steps, and for the swarm vs colocated comparison the wall time at which each first reached the
lower of the two final accuracies (from the held-out evaluations every ``eval.every``
steps; colocated only evaluates before and after).

    python bench/async.py --out bench/async.json [--steps 12] [--set key=value ...]

Prints a Markdown table. Timings are of whatever else the machine is doing at the same time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from swarmrl.config import EMBEDDED_DEFAULT, load_config

# the embedded config (task, model, warm start, RL batch) with shorter evaluation
QUICK = [
    "eval.n=200",
    "eval.control=false",
    "eval.every=2",
    "swarm.ready_timeout_s=300",
]


def warm_start(overrides: list[str]) -> str:
    """Train (or reuse, from run.cache_dir) the warm start once; every arm loads it by path."""
    from swarmrl.envs import build_env
    from swarmrl.trainer.warmstart import ensure_warm_start

    config = load_config([EMBEDDED_DEFAULT], overrides)
    return str(ensure_warm_start(config, build_env(config.env)).path)


def arm(name: str, report: dict, idle_fraction: float | None) -> dict:
    """One arm's figures from a run's report (the same keys in both modes)."""
    ev = report["eval"]
    return {
        "arm": name,
        "steps": report["steps"],
        "rl_seconds": report["rl_seconds"],
        "s_per_step": report["rl_seconds"] / report["steps"],
        "idle_fraction": idle_fraction,
        "accuracy_before": ev["before"]["accuracy"],
        "accuracy_after": ev["after"]["accuracy"],
        "curve": [(0.0, ev["before"]["accuracy"])]
        + [(r["wall_time"], r["accuracy"]) for r in ev["during"]]
        + [(report["rl_seconds"], ev["after"]["accuracy"])],
    }


def swarm_arm(overrides: list[str], async_level: int, work: Path) -> dict:
    from swarmrl.launch.swarm import run_swarm

    config = load_config([EMBEDDED_DEFAULT], [*overrides, f"rl.async_level={async_level}"])
    report = run_swarm(config, work / f"swarm-async{async_level}", display=False, timeout_s=3000)
    swarm = report["swarm"]
    return arm(f"swarm async_level={async_level}", report, swarm["trainer_idle_fraction"]) | {
        "rejected_honest": swarm["submissions"]["rejected_honest"]
    }


def colocated_arm(overrides: list[str]) -> dict:
    from swarmrl.launch.report import training_report
    from swarmrl.trainer.colocated import run_colocated

    config = load_config([EMBEDDED_DEFAULT], overrides)
    result = run_colocated(config).result
    return arm("colocated", training_report(config, "colocated", result, 0.0), None)


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in curve if acc >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/async.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="swarmrl-async-"))
    base = [*QUICK, f"rl.steps={args.steps}", "run.threads=1", *args.overrides]
    started = time.perf_counter()
    policy = warm_start(base)
    pinned = [*base, f"model.path={policy}"]
    arms = [swarm_arm(pinned, 0, work), swarm_arm(pinned, 2, work), colocated_arm(pinned)]
    target = min(a["accuracy_after"] for a in arms)
    for arm in arms:
        arm["seconds_to_common_accuracy"] = time_to(arm["curve"], target)
    Path(args.out).write_text(
        json.dumps({"overrides": pinned, "common_accuracy": target, "arms": arms}, indent=2) + "\n"
    )
    print(
        f"| arm | s/step | trainer idle | held-out acc before → after ({args.steps} steps) "
        f"| s to {target:.1%} |"
    )
    print("|---|---|---|---|---|")
    for a in arms:
        idle = "—" if a["idle_fraction"] is None else f"{a['idle_fraction']:.0%}"
        reach = a["seconds_to_common_accuracy"]
        print(
            f"| {a['arm']} | {a['s_per_step']:.1f} | {idle} | {a['accuracy_before']:.1%} → "
            f"{a['accuracy_after']:.1%} | {'—' if reach is None else f'{reach:.0f}'} |"
        )
    print(f"total {time.perf_counter() - started:.0f} s; work dir {work}")


if __name__ == "__main__":
    main()
