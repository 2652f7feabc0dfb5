"""The loss family side by side: every ``rl.loss`` on a colocated task (the embedded config's
arith, or ``--config`` such as configs/gym_arith.toml), the same warm start, the same steps, the
same seeds.

The warm start is trained (or reused from ``run.cache_dir``) once and pinned by ``model.path``,
so no arm pays for SFT and every arm starts from the same policy; each seed sets ``run.seed``
(rollout sampling and the held-out sampled evaluation). Per loss and seed: held-out greedy
accuracy before and after ``--steps`` RL steps, with ``--set eval.every=N`` the steps to reach
``--target`` held-out (the first evaluation at or above it; evaluations every N steps), and
seconds per RL step (``rl_seconds`` ÷ steps: evaluations excluded). Per loss, the median over seeds with the range, and the median
of the per-seed differences to the default ``clip`` of the same run (accuracy: points;
time: ratio).

    python bench/losses.py --steps 10 --seeds 0 1 2 [--losses clip dapo] [--set key=value ...]
    python bench/losses.py --losses clip clip+tis_token clip+mask_sequence --set inference.dtype=bfloat16
    python bench/losses.py --steps 8 --seeds 0 1 --set eval.every=1 --plot losses.png
    python bench/losses.py --config configs/gym_arith.toml --steps 40 --seeds 0 1 --set eval.every=10

Prints a Markdown table and writes every run's figures to ``--out``. Timings are of whatever
else the machine is doing at the same time; the arms run one after another, interleaved by
seed and each seed starting one loss later, so neither a change in load nor the process's first
run falls on one loss alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import string
import time
from pathlib import Path

from swarmrl.config import EMBEDDED_DEFAULT, SwarmConfig, load_config

LOSSES = ("clip", "dr_grpo", "dapo", "gspo", "cispo", "tr_mask")
# what a loss needs beyond ``rl.loss`` to be itself (docs/learning.md "Losses")
LOSS_SETTINGS = {"dapo": ["rl.eps_high=0.28"], "gspo": ["rl.eps_low=3e-4", "rl.eps_high=4e-4"]}
QUICK = ["eval.control=false", "eval.every=0", "run.threads=1"]


def char_model(config: SwarmConfig) -> Path:
    """A fresh tiny model (``model.tiny``, seeded by ``run.seed``) over printable ASCII, for a
    task without its own alphabet (a task library's prose); made once in ``run.cache_dir``."""
    import torch

    from swarmrl.model import build_char_tokenizer, create_tiny_model, save_policy

    out = Path(config.run.cache_dir).expanduser() / "bench-char-model"
    spec = f"{config.model.tiny.model_dump_json()} {config.run.seed}".encode()
    out /= hashlib.sha256(spec).hexdigest()[:16]
    if not (out / "config.json").is_file():
        tokenizer = build_char_tokenizer(string.printable)
        torch.manual_seed(config.run.seed)
        save_policy(create_tiny_model(config.model.tiny, tokenizer), tokenizer, out)
    return out


def warm_start(config_file: str, overrides: list[str]) -> str:
    """Train (or reuse, from run.cache_dir) the warm start once; every arm loads it by path. A
    task without an alphabet is warm-started from :func:`char_model`."""
    from swarmrl.envs import build_env
    from swarmrl.trainer.warmstart import ensure_warm_start

    config = load_config([config_file], overrides)
    env = build_env(config.env)
    if config.model.path is None and env.alphabet is None:
        base = json.dumps(str(char_model(config)))
        config = load_config(
            [config_file], [*overrides, f"model.path={base}", "model.warm_start=true"]
        )
    return str(ensure_warm_start(config, env).path)


CORRECTIONS = ("tis_token", "tis_sequence", "mask_token", "mask_sequence")


def arm_settings(arm: str) -> list[str]:
    """``LOSS`` or ``LOSS+CORRECTION`` (e.g. ``clip+tis_token``) as config overrides;
    ``ValueError`` for anything else."""
    loss, _, correction = arm.partition("+")
    if loss not in LOSSES or (correction and correction not in CORRECTIONS):
        raise ValueError(
            f"{arm!r}: a loss of {', '.join(LOSSES)}, optionally +{'/+'.join(CORRECTIONS)}"
        )
    settings = [f"rl.loss={json.dumps(loss)}", *LOSS_SETTINGS.get(loss, [])]
    return settings + ([f"rl.correction={json.dumps(correction)}"] if correction else [])


def parse_arm(text: str) -> str:
    """argparse type of an arm: a misspelt one fails before any run."""
    try:
        arm_settings(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def interleaved(arms: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """Every (arm, seed), seed by seed, each seed starting one arm later: neither a change in
    load nor the process's first run falls on one arm alone."""
    return [
        (a, seed)
        for i, seed in enumerate(seeds)
        for a in arms[i % len(arms) :] + arms[: i % len(arms)]
    ]


def one_run(config_file: str, overrides: list[str], loss: str, seed: int) -> dict:
    from swarmrl.trainer.colocated import run_colocated

    config = load_config([config_file], [*overrides, f"run.seed={seed}", *arm_settings(loss)])
    result = run_colocated(config).result
    # an evaluation "during" RL at step s is taken after s optimizer steps (trainer.loop)
    curve = [(0, result.evals["before"]["accuracy"])]
    curve += [(e["step"], e["accuracy"]) for e in result.during if e.get("accuracy") is not None]
    curve.append((result.steps, result.evals["after"]["accuracy"]))
    return {
        "loss": loss,
        "seed": seed,
        "accuracy_before": result.evals["before"]["accuracy"],
        "accuracy_after": result.evals["after"]["accuracy"],
        "curve": curve,
        "s_per_step": result.rl_seconds / max(result.steps, 1),
        "mismatch_kl": [row["mismatch_kl"] for row in result.history],
    }


def steps_to(curve: list[tuple[int, float]], target: float) -> int | None:
    """Steps trained before the first held-out evaluation at or above ``target`` (None: never)."""
    return next((step for step, acc in curve if acc >= target), None)


def steps_text(values: list[int | None], steps: int) -> str:
    """Median steps to the target over seeds, of the seeds that reached it; the others counted."""
    reached = [float(v) for v in values if v is not None]
    never = len(values) - len(reached)
    if not reached:
        return f"> {steps} (all)"
    text = spread(reached, ".0f")
    return text if not never else f"{text}; {never} of {len(values)} never (> {steps})"


def low_after(curve: list[tuple[int, float]], target: float) -> float | None:
    """The lowest held-out accuracy at or after the first evaluation that reached ``target``:
    how far a run fell back once there (None: never reached)."""
    reached = steps_to(curve, target)
    return None if reached is None else min(acc for step, acc in curve if step >= reached)


def plot(
    curves: dict[str, list[list[tuple[int, float]]]], target: float, path: Path, title: str
) -> None:
    """Held-out accuracy per step: one colour per arm (the keys), one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = plt.get_cmap("tab10")
    for i, (arm, runs) in enumerate(curves.items()):
        for j, curve in enumerate(runs):
            xs, ys = zip(*curve, strict=True)
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


def spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def table(runs: list[dict], losses: list[str], steps: int, target: float | None) -> list[str]:
    """Markdown rows: per loss, medians over seeds and the per-seed differences to clip."""
    by = {(r["loss"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    lines = [
        f"| loss | held-out before → after {steps} steps, median (range) | "
        "Δ after vs clip, points | "
        + (f"steps to {target:.0%} | lowest after reaching it | " if target is not None else "")
        + "s/step | s/step ÷ clip |",
        "|---|---|---|---|---|" + ("---|---|" if target is not None else ""),
    ]
    for loss in losses:
        mine = [by[loss, s] for s in seeds]
        delta = ratio = "—"
        if "clip" in losses:
            clip = [by["clip", s] for s in seeds]
            delta = spread(
                [
                    100 * (m["accuracy_after"] - c["accuracy_after"])
                    for m, c in zip(mine, clip, strict=True)
                ],
                "+.1f",
            )
            ratio = spread(
                [m["s_per_step"] / c["s_per_step"] for m, c in zip(mine, clip, strict=True)], ".2f"
            )
        before = spread([100 * m["accuracy_before"] for m in mine], ".1f")
        after = spread([100 * m["accuracy_after"] for m in mine], ".1f")
        per_step = spread([m["s_per_step"] for m in mine], ".2f")
        reach = ""
        if target is not None:
            reach = steps_text([steps_to(m["curve"], target) for m in mine], steps) + " | "
            lows = [low_after(m["curve"], target) for m in mine]
            reached = [100 * v for v in lows if v is not None]
            reach += (spread(reached, ".1f") + " %" if reached else "—") + " | "
        lines.append(f"| {loss} | {before} % → {after} % | {delta} | {reach}{per_step} | {ratio} |")
    return lines


def report(runs: list[dict], overrides: list[str], args: argparse.Namespace) -> None:
    """The table (stdout) and, with ``--plot`` and evaluations during RL, the plot of ``runs``."""
    config = load_config([args.config], overrides)
    losses = list(dict.fromkeys(r["loss"] for r in runs))
    evaluated = config.eval.every > 0
    print("\n".join(table(runs, losses, config.rl.steps, args.target if evaluated else None)))
    if args.plot and evaluated:
        title = (
            f"colocated (torch); {config.env.name}, {config.rl.prompts_per_step}×{config.rl.group_size} per "
            f"step, lr {config.rl.lr:g}; seeds {sorted({r['seed'] for r in runs})}"
        )
        curves = {loss: [r["curve"] for r in runs if r["loss"] == loss] for loss in losses}
        plot(curves, args.target, Path(args.plot), title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(EMBEDDED_DEFAULT), help="TOML config of the task")
    parser.add_argument("--out", default="bench/losses.json")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--losses",
        nargs="+",
        default=list(LOSSES),
        type=parse_arm,
        help="losses, or LOSS+CORRECTION arms (clip+tis_token): the corrections act where the "
        "generator's engine differs from the trainer's (--set inference.dtype=bfloat16)",
    )
    parser.add_argument("--target", type=float, default=0.8, help="held-out accuracy to reach")
    parser.add_argument("--plot", help="with eval.every > 0: held-out accuracy per step, PNG")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--table", metavar="JSON", help="only print the table (and plot) of JSON")
    args = parser.parse_args()
    if args.table:
        saved = json.loads(Path(args.table).read_text())
        args.config = saved.get("config", str(EMBEDDED_DEFAULT))
        report(saved["runs"], saved["overrides"], args)
        return
    started = time.perf_counter()
    base = [*QUICK, f"rl.steps={args.steps}", *args.overrides]
    warm = warm_start(args.config, base)
    pinned = [*base, f"model.path={json.dumps(warm)}", "model.warm_start=false"]
    order = interleaved(args.losses, args.seeds)
    runs = []
    for n, (loss, seed) in enumerate(order, 1):
        runs.append(one_run(args.config, pinned, loss, seed))
        done = runs[-1]
        print(
            f"[{n}/{len(order)}] {loss} seed {seed}: {100 * done['accuracy_before']:.1f} % -> "
            f"{100 * done['accuracy_after']:.1f} % ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    saved = {"config": args.config, "overrides": pinned, "runs": runs}
    Path(args.out).write_text(json.dumps(saved, indent=2) + "\n")
    report(runs, pinned, args)
    print(f"total {time.perf_counter() - started:.0f} s; figures in {args.out}")


if __name__ == "__main__":
    main()
