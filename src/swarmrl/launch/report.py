"""Run directories, per-step metrics, the final report, its plot, and the live progress view.

Every run writes ``runs/<name>-<UTC timestamp>/``::

    config.json     the resolved config
    metrics.jsonl   one JSON object per RL step, the training loop's row
                    (``swarmrl.trainer.loop.ROW_KEYS``: the same keys in every mode)
    report.json     mode, steps, wall_seconds, rl_seconds, warm start, seed, env,
                    eval.{n, before, after, control, during}; a swarm run adds its swarm facts
    report.png      reward and accuracy per step, with the held-out evals as marked points

The colocated and the swarm modes both turn the loop's ``TrainingResult`` into these files
with :func:`record_training`; knows nothing about how steps are computed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from swarmrl.config import SwarmConfig, save_config
from swarmrl.trainer.loop import TrainingResult


def new_run_dir(config: SwarmConfig) -> Path:
    """A fresh ``run.run_dir/<name>-<YYYYmmdd-HHMMSS>`` (suffixed if it already exists)."""
    parent = Path(config.run.run_dir).expanduser()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = parent / f"{config.run.name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = parent / f"{config.run.name}-{stamp}-{n}"
    path.mkdir(parents=True)
    return path


class RunRecorder:
    """Writes a run directory: config first, then one metrics line per step, then the report."""

    def __init__(self, config: SwarmConfig, run_dir: Path | None = None) -> None:
        self.config = config
        self.dir = run_dir if run_dir is not None else new_run_dir(config)
        self.dir.mkdir(parents=True, exist_ok=True)
        save_config(config, self.dir)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.metrics_path.write_text("")
        self.rows: list[dict[str, Any]] = []

    def log_step(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def write_report(self, report: dict[str, Any]) -> Path:
        path = self.dir / "report.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        plot_report(self.rows, report.get("eval", {}), self.dir / "report.png")
        return path


def training_report(
    config: SwarmConfig, mode: str, result: TrainingResult, wall_seconds: float
) -> dict[str, Any]:
    """report.json's common part, from the training loop's result (same keys in every mode)."""
    return {
        "mode": mode,
        "steps": result.steps,
        "wall_seconds": wall_seconds,
        "rl_seconds": result.rl_seconds,
        "warm_start": result.warm_start,
        "eval": {"n": result.evals["before"]["n"], **result.evals, "during": result.during},
        "seed": config.run.seed,
        "env": config.env.name,
    }


def record_training(
    recorder: RunRecorder,
    mode: str,
    result: TrainingResult,
    wall_seconds: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write any step rows not yet logged, then report.json (plus ``extra``) and the plot."""
    for row in result.history[len(recorder.rows) :]:
        recorder.log_step(row)
    report = training_report(recorder.config, mode, result, wall_seconds) | (extra or {})
    recorder.write_report(report)
    return report


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_report(rows: list[dict[str, Any]], evals: dict[str, Any], out: Path) -> Path:
    """Reward and rollout accuracy per step; held-out accuracies as marked points (before at
    the first step, after and control at the last)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["reward_mean"] for r in rows], label="reward (mean over rollouts)")
    ax.plot(
        steps,
        [r["accuracy"] for r in rows],
        linestyle=":",
        linewidth=2,
        label="accuracy (rollouts)",
    )
    last = steps[-1] if steps else 0
    points = {
        "before": (0, "o", "grey", "held-out before"),
        "after": (last, "*", "green", "held-out after RL"),
        "control": (last, "X", "red", "held-out control (SFT continued)"),
    }
    during = [e for e in evals.get("during", []) if e.get("accuracy") is not None]
    if during:
        ax.plot(
            [e["step"] for e in during],
            [e["accuracy"] for e in during],
            marker="d",
            linestyle="none",
            color="green",
            alpha=0.6,
            label="held-out during RL",
        )
    for key, (x, marker, colour, label) in points.items():
        result = evals.get(key)
        if isinstance(result, dict) and result.get("accuracy") is not None:
            ax.scatter(
                [x],
                [result["accuracy"]],
                marker=marker,
                s=90,
                color=colour,
                zorder=3,
                label=f"{label}: {result['accuracy']:.1%}",
            )
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("reward and accuracy per step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


class ProgressView:
    """A live terminal table of the run: phase, warm-start progress, the latest step's numbers.

    Falls back to one plain line per event when the output is not a terminal.
    """

    def __init__(self, total_steps: int, sft_steps: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.total, self.sft_total = total_steps, sft_steps
        self.phase, self.sft = "starting", ""
        self.row: dict[str, Any] = {}
        self.evals: dict[str, str] = {}
        self.live = (
            Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            if self.console.is_terminal
            else None
        )

    def __enter__(self) -> ProgressView:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def _table(self) -> Table:
        table = Table(title="swarmrl", show_header=False, expand=False)
        table.add_row("phase", self.phase)
        if self.sft:
            table.add_row("warm start", self.sft)
        r = self.row
        if r:
            table.add_row("step", f"{r['step'] + 1}/{self.total}")
            table.add_row("reward", _fmt(r.get("reward_mean"), ".3f"))
            table.add_row("rollout accuracy", _fmt(r.get("accuracy"), ".1%"))
            table.add_row(
                "loss / clip / grad",
                f"{_fmt(r.get('loss'), '+.4f')} / {_fmt(r.get('clip_fraction'), '.3f')}"
                f" / {_fmt(r.get('grad_norm'), '.3f')}",
            )
            table.add_row("tokens/s", _fmt(r.get("tokens_per_s"), ".0f"))
            table.add_row("elapsed", f"{r.get('wall_time', 0.0):.1f} s")
        for name, text in self.evals.items():
            table.add_row(f"held-out {name}", text)
        return table

    def _refresh(self, line: str | None = None) -> None:
        if self.live is not None:
            self.live.update(self._table())
        elif line:
            self.console.print(line, highlight=False, markup=False)

    def on_phase(self, phase: str) -> None:
        self.phase = phase
        self._refresh(f"[{phase}]")

    def on_sft_step(self, step: int, loss: float) -> None:
        self.sft = f"step {step}/{self.sft_total}  loss {loss:.3f}"
        self._refresh(None if step % 50 else f"warm start {self.sft}")

    def on_step(self, row: dict[str, Any]) -> None:
        self.row = row
        self._refresh(
            f"step {row['step'] + 1}/{self.total} reward {row['reward_mean']:.3f} "
            f"acc {row['accuracy']:.1%} loss {_fmt(row.get('loss'), '+.4f')}"
        )

    def on_eval(self, name: str, result: dict[str, Any]) -> None:
        self.evals[name] = f"{result['accuracy']:.1%} greedy, {result['pass_at_1']:.1%} pass@1"
        self._refresh(f"held-out {name}: {self.evals[name]}")
