"""The loss family under a swarm's train/inference mismatch: every chosen ``rl.loss`` through a
local swarm (``swarmrl run``: orchestrator, trainer, relay, validator and workers, each its own
process) on the arith task (the embedded config), the same warm start, the same seeds.

Colocated (``bench/losses.py``) the ratio is 1 at the gradient, so dapo, cispo and tr_mask
equal clip there. In a swarm the trainer trains on versions ≥ n − ``rl.async_level`` that
workers sampled, on their own engines: the behaviour log-probs differ from the trainer's by the
samples' staleness (and, with ``--set inference.backend=vllm``, by the engines), and the
family separates. The warm start is trained (or reused, from ``run.cache_dir``) once and pinned
by ``model.path``, so no arm pays for SFT; each seed sets ``run.seed``.

An arm is a loss, or a loss and an ``rl.correction`` (``clip+tis_token``). Per arm and seed:
held-out greedy accuracy before, during (every ``eval.every`` steps) and after; the first step whose held-out accuracy reached ``--target``; the per-step mean of
``mismatch_kl``, ``corrected_fraction``, ``clip_fraction`` and the largest ``staleness_max``
from the run's ``metrics.jsonl``; seconds per RL step and the whole run's wall time (the swarm's
start included). Per arm, the median over seeds with the range.

    python bench/losses_swarm.py --steps 8 --seeds 0 1 [--arms clip cispo clip+tis_token]
        [--plot out.png]
        [--set key=value ...]

Prints a Markdown table, writes every run's figures to ``--out`` and the held-out accuracy per
step and arm to ``--plot``. Timings are of whatever else the machine is doing at the same
time; the arms run one after another, interleaved by seed and each seed starting one arm
later, so neither a change in load nor the first run falls on one arm alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from losses import (
    LOSSES,
    arm_settings,
    interleaved,
    low_after,
    parse_arm,
    plot,
    spread,
    steps_text,
    steps_to,
    warm_start,
)
from swarmrl.config import EMBEDDED_DEFAULT, load_config

# the embedded config's task, model, warm start and lr; 8 prompts a step instead of 32 (at 16,
# bench/losses.py's batch, one swarm step took held-out accuracy from 48 % to 80 %: nothing left
# to tell the losses apart by steps); a held-out evaluation every step; no SFT control (it runs
# in the trainer alone: nothing to compare here)
QUICK = [
    "rl.prompts_per_step=8",
    "eval.control=false",
    "eval.every=1",
    "eval.n=200",
    "run.threads=1",
    "swarm.workers=2",
    "swarm.ready_timeout_s=300",
]


def one_run(overrides: list[str], arm: str, seed: int, work: Path, timeout_s: float) -> dict:
    from swarmrl.launch.swarm import run_swarm

    config = load_config([EMBEDDED_DEFAULT], [*overrides, *arm_settings(arm), f"run.seed={seed}"])
    run_dir = work / f"{arm}-seed{seed}"
    started = time.perf_counter()
    report = run_swarm(config, run_dir, display=False, timeout_s=timeout_s)
    wall = time.perf_counter() - started
    ev = report["eval"]
    steps = report["steps"]
    # an evaluation "during" RL at step s is taken after s optimizer steps (trainer.loop)
    curve = [(0, ev["before"]["accuracy"])]
    curve += [(e["step"], e["accuracy"]) for e in ev["during"] if e.get("accuracy") is not None]
    if not curve or curve[-1][0] != steps:
        curve.append((steps, ev["after"]["accuracy"]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    swarm = report.get("swarm", {})
    return {
        "arm": arm,
        "seed": seed,
        "run_dir": str(run_dir),
        "status": report["status"],
        "steps": steps,
        "accuracy_before": ev["before"]["accuracy"],
        "accuracy_after": ev["after"]["accuracy"],
        "curve": curve,
        "s_per_step": report["rl_seconds"] / max(steps, 1),
        "wall_s": wall,
        "mismatch_kl": statistics.fmean(r["mismatch_kl"] for r in rows),
        "corrected_fraction": statistics.fmean(r["corrected_fraction"] for r in rows),
        "clip_fraction": statistics.fmean(r["clip_fraction"] for r in rows),
        "staleness_max": max(r["staleness_max"] for r in rows),
        "per_step": [
            {k: r[k] for k in ("step", "mismatch_kl", "corrected_fraction", "clip_fraction")}
            for r in rows
        ],
        "trainer_idle_fraction": swarm.get("trainer_idle_fraction"),
        "rejected_honest": swarm.get("submissions", {}).get("rejected_honest"),
    }


def table(runs: list[dict], arms: list[str], steps: int, target: float) -> list[str]:
    """Markdown rows: per arm, medians over seeds (range)."""
    by = {(r["arm"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    lines = [
        f"| arm | held-out before → after {steps} steps | steps to {target:.0%} | "
        f"lowest after reaching {target:.0%} | mismatch_kl (mean/step) | corrected_fraction | "
        "clip_fraction | staleness max | s/step | run wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        mine = [by[arm, s] for s in seeds]
        before = spread([100 * m["accuracy_before"] for m in mine], ".1f")
        after = spread([100 * m["accuracy_after"] for m in mine], ".1f")
        reach = steps_text([steps_to(m["curve"], target) for m in mine], steps)
        lows = [low_after(m["curve"], target) for m in mine]
        low = spread([100 * v for v in lows if v is not None], ".1f") if any(lows) else "—"
        mismatch = spread([m["mismatch_kl"] for m in mine], ".2e")
        corrected = spread([100 * m["corrected_fraction"] for m in mine], ".1f")
        clipped = spread([100 * m["clip_fraction"] for m in mine], ".1f")
        stale = spread([float(m["staleness_max"]) for m in mine], ".0f")
        per_step = spread([m["s_per_step"] for m in mine], ".1f")
        wall = spread([m["wall_s"] for m in mine], ".0f")
        lines.append(
            f"| {arm} | {before} % → {after} % | {reach} | {low} % | {mismatch} | {corrected} % | "
            f"{clipped} % | {stale} | {per_step} | {wall} |"
        )
    return lines


def report(runs: list[dict], overrides: list[str], args: argparse.Namespace) -> None:
    """The table (stdout) and the plot (``--plot``) of ``runs``."""
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    steps = runs[0]["steps"]
    print("\n".join(table(runs, arms, steps, args.target)))
    config = load_config([EMBEDDED_DEFAULT], overrides)
    title = (
        f"swarm: {config.swarm.workers} workers on {config.inference.backend}, "
        f"rl.async_level={config.rl.async_level}; {config.env.name}, "
        f"{config.rl.prompts_per_step}×"
        f"{config.rl.group_size} per step, lr {config.rl.lr:g}; "
        f"seeds {sorted({r['seed'] for r in runs})}"
    )
    curves = {arm: [r["curve"] for r in runs if r["arm"] == arm] for arm in arms}
    plot(curves, args.target, Path(args.plot), title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/losses_swarm.json")
    parser.add_argument("--plot", default="bench/losses_swarm.png")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--arms",
        nargs="+",
        default=[*LOSSES, "clip+tis_token"],
        type=parse_arm,
        help="LOSS or LOSS+CORRECTION (rl.correction), e.g. clip+tis_token",
    )
    parser.add_argument("--target", type=float, default=0.8, help="held-out accuracy to reach")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per swarm run")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--table",
        metavar="JSON",
        nargs="+",
        help="only print the table and plot of saved runs (several files: the same settings, "
        "other seeds)",
    )
    args = parser.parse_args()
    if args.table:
        saved = [json.loads(Path(path).read_text()) for path in args.table]
        report([r for one in saved for r in one["runs"]], saved[0]["overrides"], args)
        return
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="swarmrl-losses-swarm-"))
    base = [*QUICK, f"rl.steps={args.steps}", *args.overrides]
    pinned = [*base, f"model.path={json.dumps(warm_start(str(EMBEDDED_DEFAULT), base))}"]
    runs = []
    for name, seed in interleaved(args.arms, args.seeds):
        runs.append(one_run(pinned, name, seed, work, args.timeout))
        print(
            f"{name} seed {seed}: {runs[-1]['curve']} mismatch_kl "
            f"{runs[-1]['mismatch_kl']:.2e} wall {runs[-1]['wall_s']:.0f} s",
            flush=True,
        )
        Path(args.out).write_text(json.dumps({"overrides": pinned, "runs": runs}, indent=2) + "\n")
    report(runs, pinned, args)
    print(
        f"total {time.perf_counter() - started:.0f} s; figures in {args.out}, plot {args.plot}, "
        f"runs in {work}"
    )


if __name__ == "__main__":
    main()
