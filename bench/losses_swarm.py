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

from swarmrl.config import EMBEDDED_DEFAULT, load_config

LOSSES = ("clip", "dr_grpo", "dapo", "gspo", "cispo", "tr_mask")
# what a loss needs beyond ``rl.loss`` to be itself (docs/learning.md "Losses")
CORRECTIONS = ("tis_token", "tis_sequence", "mask_token", "mask_sequence")
LOSS_SETTINGS = {"dapo": ["rl.eps_high=0.28"], "gspo": ["rl.eps_low=3e-4", "rl.eps_high=4e-4"]}
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


def warm_start(overrides: list[str]) -> str:
    """Train (or reuse, from run.cache_dir) the warm start once; every arm loads it by path."""
    from swarmrl.envs import build_env
    from swarmrl.trainer.warmstart import ensure_warm_start

    config = load_config([EMBEDDED_DEFAULT], overrides)
    return str(ensure_warm_start(config, build_env(config.env)).path)


def steps_to(curve: list[tuple[int, float]], target: float) -> int | None:
    """Steps trained before the first held-out evaluation at or above ``target`` (None: never)."""
    return next((step for step, acc in curve if acc >= target), None)


def arm_settings(arm: str) -> list[str]:
    """``LOSS`` or ``LOSS+CORRECTION`` (e.g. ``clip+tis_token``) as config overrides."""
    loss, _, correction = arm.partition("+")
    if loss not in LOSSES or (correction and correction not in CORRECTIONS):
        raise SystemExit(
            f"--arms: {arm!r} is not LOSS or LOSS+CORRECTION ({LOSSES}, {CORRECTIONS})"
        )
    settings = [f"rl.loss={json.dumps(loss)}", *LOSS_SETTINGS.get(loss, [])]
    return settings + ([f"rl.correction={json.dumps(correction)}"] if correction else [])


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


def low_after(curve: list[tuple[int, float]], target: float) -> float | None:
    """The lowest held-out accuracy at or after the first evaluation that reached ``target``:
    how far a run fell back once there (None: never reached)."""
    reached = steps_to(curve, target)
    return None if reached is None else min(acc for step, acc in curve if step >= reached)


def _spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def _steps_text(values: list[int | None], steps: int) -> str:
    """Median steps to the target over seeds; a run that never reached it counts as > steps."""
    reached = sorted(v for v in values if v is not None)
    never = len(values) - len(reached)
    if not reached:
        return f"> {steps} (all)"
    text = _spread([float(v) for v in reached], ".0f")
    return text if not never else f"{text}; {never} of {len(values)} never (> {steps})"


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
        before = _spread([100 * m["accuracy_before"] for m in mine], ".1f")
        after = _spread([100 * m["accuracy_after"] for m in mine], ".1f")
        reach = _steps_text([steps_to(m["curve"], target) for m in mine], steps)
        lows = [low_after(m["curve"], target) for m in mine]
        low = _spread([100 * v for v in lows if v is not None], ".1f") if any(lows) else "—"
        mismatch = _spread([m["mismatch_kl"] for m in mine], ".2e")
        corrected = _spread([100 * m["corrected_fraction"] for m in mine], ".1f")
        clipped = _spread([100 * m["clip_fraction"] for m in mine], ".1f")
        stale = _spread([float(m["staleness_max"]) for m in mine], ".0f")
        per_step = _spread([m["s_per_step"] for m in mine], ".1f")
        wall = _spread([m["wall_s"] for m in mine], ".0f")
        lines.append(
            f"| {arm} | {before} % → {after} % | {reach} | {low} % | {mismatch} | {corrected} % | "
            f"{clipped} % | {stale} | {per_step} | {wall} |"
        )
    return lines


def plot(runs: list[dict], arms: list[str], target: float, path: Path, title: str) -> None:
    """Held-out accuracy per step: one colour per arm, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = plt.get_cmap("tab10")
    for i, arm in enumerate(arms):
        for j, run in enumerate(r for r in runs if r["arm"] == arm):
            xs, ys = zip(*run["curve"], strict=True)
            ax.plot(
                xs,
                [100 * y for y in ys],
                marker="o",
                markersize=3,
                color=colours(i),
                alpha=0.8,
                label=arm if j == 0 else None,
            )
    ax.axhline(100 * target, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("RL step (optimizer steps before the evaluation)")
    ax.set_ylabel("held-out greedy accuracy, %")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(runs: list[dict], overrides: list[str], args: argparse.Namespace) -> None:
    """The table (stdout) and the plot (``--plot``) of ``runs``."""
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    steps = runs[0]["steps"]
    print("\n".join(table(runs, arms, steps, args.target)))
    config = load_config([EMBEDDED_DEFAULT], overrides)
    title = (
        f"swarm: {config.swarm.workers} workers on {config.inference.backend}, "
        f"rl.async_level={config.rl.async_level}; arith, {config.rl.prompts_per_step}×"
        f"{config.rl.group_size} per step, lr {config.rl.lr:g}; "
        f"seeds {sorted({r['seed'] for r in runs})}"
    )
    plot(runs, arms, args.target, Path(args.plot), title)


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
        help="LOSS or LOSS+CORRECTION (rl.correction), e.g. clip+tis_token",
    )
    parser.add_argument("--target", type=float, default=0.8, help="held-out accuracy to reach")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per swarm run")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--table", metavar="JSON", help="only print the table and plot of --out")
    args = parser.parse_args()
    if args.table:
        saved = json.loads(Path(args.table).read_text())
        report(saved["runs"], saved["overrides"], args)
        return
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="swarmrl-losses-swarm-"))
    for arm in args.arms:
        arm_settings(arm)  # a misspelt arm fails before any run
    base = [*QUICK, f"rl.steps={args.steps}", *args.overrides]
    pinned = [*base, f"model.path={json.dumps(warm_start(base))}"]
    runs = []
    for i, seed in enumerate(args.seeds):
        order = args.arms[i % len(args.arms) :] + args.arms[: i % len(args.arms)]
        for arm in order:
            runs.append(one_run(pinned, arm, seed, work, args.timeout))
            print(
                f"{arm} seed {seed}: {runs[-1]['curve']} mismatch_kl "
                f"{runs[-1]['mismatch_kl']:.2e} wall {runs[-1]['wall_s']:.0f} s",
                flush=True,
            )
            Path(args.out).write_text(
                json.dumps({"overrides": pinned, "runs": runs}, indent=2) + "\n"
            )
    report(runs, pinned, args)
    print(
        f"total {time.perf_counter() - started:.0f} s; figures in {args.out}, plot {args.plot}, "
        f"runs in {work}"
    )


if __name__ == "__main__":
    main()
