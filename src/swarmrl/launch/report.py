"""Run directories, per-step metrics, the final report, its plot, and the live progress view.

Every run writes ``runs/<name>-<UTC timestamp>/``::

    config.json     the resolved config
    metrics.jsonl   one JSON object per RL step, the training loop's row
                    (``swarmrl.trainer.loop.ROW_KEYS``: the same keys in every mode)
    report.json     status, mode, steps, wall_seconds, rl_seconds, warm start, seed, env,
                    eval.{n, before, after, control, during}; a swarm run adds its swarm facts
    policy/         the trained policy, saved as soon as RL is over (before the control)
    report.png      reward and accuracy per step, with the held-out evals as marked points; a
                    swarm run adds its timeline (``swarmrl.launch.flow``): submissions accepted,
                    rejected and trained over time, versions published, the trainer busy or idle
                    and the staleness it trained at; report.json's ``swarm.wasted_share`` is the
                    share of kept submissions never trained (the words: ``swarmrl.ledger.counts``)

``metrics.jsonl`` and ``report.json`` are written as the run goes: report.json's ``status`` is
``running`` until the run ends ``completed``, ``interrupted`` (Ctrl-C, SIGTERM) or ``failed``;
an interrupted or failed report still holds every step and evaluation already finished, and a
failed one its ``reason``: one line, the one the console printed (:func:`failure_reason`).
While the run goes, ``.reserve`` holds :data:`RESERVE_BYTES` of the disk, given back just
before the final report is written, so that a run stopped by a full disk still says so; a
write the disk refuses is a :class:`~swarmrl.errors.DiskWriteError` and leaves no partial file.

The colocated and the swarm modes both turn the loop's ``TrainingResult`` into these files
with :func:`record_training`; knows nothing about how steps are computed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.live import Live
from rich.table import Table

from swarmrl.config import SwarmConfig, save_config
from swarmrl.errors import DiskWriteError, UserError
from swarmrl.launch.flow import plot_flow
from swarmrl.shardcast.publisher import WRITE_FAULTS
from swarmrl.trainer.loop import TrainingResult

log = logging.getLogger(__name__)

RESERVE_NAME = ".reserve"
# room kept for what a run writes at its end (report.json, report.png, metrics): a few hundred kB
RESERVE_BYTES = 4 << 20


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


RunStatus = Literal["running", "completed", "interrupted", "failed"]


class RunRecorder:
    """Writes a run directory as the run goes: config and a ``running`` report.json first, one
    metrics line per step, the report again after each step and evaluation, and the final
    report (with its plot) when the run ends, however it ends."""

    def __init__(self, config: SwarmConfig, run_dir: Path | None = None, mode: str = "") -> None:
        self.config, self.mode = config, mode
        self.dir = run_dir if run_dir is not None else new_run_dir(config)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.reserve = self.dir / RESERVE_NAME
        self.metrics_path = self.dir / "metrics.jsonl"
        with self._writing(f"keeping {RESERVE_BYTES >> 20} MiB free for the run's report"):
            _hold(self.reserve, RESERVE_BYTES)
        with self._writing("writing config.json and metrics.jsonl"):
            save_config(config, self.dir)
            self.metrics_path.write_text("")
        self.rows: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.result = TrainingResult()  # the loop's, once it is handed over (``follow``)
        self.write_report({"status": "running", "mode": mode}, plot=False)

    def follow(self, result: TrainingResult) -> None:
        """The loop's result as it fills in (``Hooks.on_start``); reported from now on."""
        self.result = result
        self.progress()

    def log_step(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with self._writing("appending to metrics.jsonl"), self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def progress(self, extra: dict[str, Any] | None = None) -> None:
        """report.json with status ``running`` from what the loop has finished so far."""
        self.finish("running", extra)

    def finish(
        self,
        status: RunStatus,
        extra: dict[str, Any] | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        """Write the rows not yet logged and report.json with ``status`` (the plot too, once
        the run has ended; before that, the room kept for them is given back); a failed run's
        report says why (``reason``, one line). Returns the report."""
        if status != "running":
            self.reserve.unlink(missing_ok=True)
        extra = (extra or {}) | ({"reason": reason} if reason is not None else {})
        return record_training(
            self, self.mode, self.result, time.monotonic() - self.started, extra, status
        )

    def write_report(self, report: dict[str, Any], plot: bool = True) -> Path:
        path = self.dir / "report.json"
        scratch = path.with_suffix(".json.partial")  # a reader never sees half a report
        with self._writing("writing report.json", scratch):
            scratch.write_text(json.dumps(report, indent=2) + "\n")
            scratch.replace(path)
        if plot:
            flow = report.get("swarm", {}).get("flow") or None
            image = self.dir / "report.png"
            try:
                with self._writing("writing report.png", image):
                    plot_report(self.rows, report.get("eval", {}), image, flow)
            except DiskWriteError as exc:  # report.json, written, holds what the plot shows
                log.warning("%s", exc)
        return path

    def _writing(
        self, what: str, partial: Path | None = None
    ) -> contextlib.AbstractContextManager[None]:
        return disk_writes(f"{what} in {self.dir}", partial)


@contextlib.contextmanager
def disk_writes(what: str, partial: Path | None = None) -> Iterator[None]:
    """A block of writes: an error of a disk that cannot keep what is written (full, read-only,
    failing) becomes one :class:`DiskWriteError` saying ``what`` was being written; ``partial``
    (a file the block writes) is removed after any error."""
    try:
        yield
    except BaseException as exc:
        if partial is not None:
            partial.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in WRITE_FAULTS:
            raise DiskWriteError(f"{what} failed: {exc}") from exc
        raise


def _hold(path: Path, size: int) -> None:
    """Make ``path`` a file of ``size`` bytes that holds its disk blocks (not a sparse one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.write(fd, bytes(size))  # a filesystem without fallocate
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def failure_reason(exc: BaseException) -> str:
    """Why a run failed, in one line: the first line of what ``swarmrl VERB`` prints after
    its name (``swarmrl.cli``: ``error: …`` for a :class:`UserError`, ``Type: …`` otherwise).
    A role that died gives its own last words there (``swarmrl.rolekit.supervisor``)."""
    lines = str(exc).strip().splitlines()
    said = lines[0] if lines else ""
    if isinstance(exc, UserError):
        return f"error: {said}"
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the disk holding ``path``; None where it cannot be told."""
    try:
        disk = os.statvfs(path)
    except OSError:
        return None
    return disk.f_bavail * disk.f_frsize


def full_disk(run_dir: Path, exc: BaseException) -> DiskWriteError | None:
    """When the disk holding ``run_dir`` has no room left (less than :data:`RESERVE_BYTES`
    free), the error that says so, quoting ``exc``, whatever role or write met the full disk
    first; None when there is room."""
    free = free_bytes(run_dir)
    if free is None or free >= RESERVE_BYTES:
        return None
    return DiskWriteError(
        f"the disk holding {run_dir} is full ({free / 1e6:.1f} MB free): {failure_reason(exc)}"
    )


def training_report(
    config: SwarmConfig,
    mode: str,
    result: TrainingResult,
    wall_seconds: float,
    status: RunStatus = "completed",
) -> dict[str, Any]:
    """report.json's common part, from the training loop's result (same keys in every mode);
    a run that did not complete reports the steps and evaluations it finished."""
    n = result.evals.get("before", {}).get("n", config.eval.n)
    evals: dict[str, Any] = {"n": n, **result.evals, "during": result.during}
    if "control" not in evals:
        evals["control_skipped"] = control_skipped(config)
    return {
        "status": status,
        "mode": mode,
        "steps": result.steps,
        "wall_seconds": wall_seconds,
        "rl_seconds": result.rl_seconds,
        "warm_start": result.warm_start,
        "eval": evals,
        "seed": config.run.seed,
        "env": config.env.name,
    }


def control_skipped(config: SwarmConfig) -> str:
    """Why report.json has no control arm, and how to get one."""
    if config.model.path is not None and not config.model.warm_start:
        return "model.path without model.warm_start: there is no warm-start SFT to continue"
    if not config.eval.control:
        return (
            "eval.control=false; add --set eval.control=true to also continue the warm start's "
            "SFT for the RL wall time and evaluate it (costs about as much as the RL)"
        )
    return "the run ended before the control finished"


def record_training(
    recorder: RunRecorder,
    mode: str,
    result: TrainingResult,
    wall_seconds: float,
    extra: dict[str, Any] | None = None,
    status: RunStatus = "completed",
) -> dict[str, Any]:
    """Write any step rows not yet logged, then report.json (plus ``extra``) and, unless the
    run is still going, the plot. A history that no longer begins with the rows logged (a swarm
    trainer started again without a checkpoint trains from step 0 anew) replaces them."""
    if _marks(result.history[: len(recorder.rows)]) != _marks(recorder.rows):
        recorder.rows = []
        recorder.metrics_path.write_text("")
    for row in result.history[len(recorder.rows) :]:
        recorder.log_step(row)
    report = training_report(recorder.config, mode, result, wall_seconds, status) | (extra or {})
    recorder.write_report(report, plot=status != "running")
    return report


def _marks(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What tells rows apart: step, version and time."""
    return [(r["step"], r["policy_version"], r["wall_time"]) for r in rows]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_report(
    rows: list[dict[str, Any]],
    evals: dict[str, Any],
    out: Path,
    flow: dict[str, Any] | None = None,
) -> Path:
    """Reward and rollout accuracy per step; held-out accuracies as marked points (before at
    the first step, after and control at the last). A swarm run's ``flow``
    (``swarmrl.launch.flow``) adds its timeline below: submissions over time, the trainer busy
    or idle, and the staleness of what it trained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if flow:
        fig, (ax, ax_counts, ax_trainer) = plt.subplots(
            3, 1, figsize=(9, 11), dpi=110, gridspec_kw={"height_ratios": [3, 3, 2]}
        )
        plot_flow(ax_counts, ax_trainer, flow)
    else:
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
        self.sft_began: tuple[float, int] | None = None  # (clock, step) at the first SFT step
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
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def on_phase(self, phase: str) -> None:
        self.phase = phase
        self._refresh(f"[{phase}]")

    def on_sft_step(self, step: int, loss: float) -> None:
        now = time.monotonic()
        if self.sft_began is None:
            self.sft_began = (now, step)
        began, first = self.sft_began
        rate = (step - first) / (now - began) if now > began else 0.0
        left = f"  about {(self.sft_total - step) / rate:.0f} s left" if rate > 0 else ""
        self.sft = f"step {step}/{self.sft_total}  loss {loss:.3f}{left}"
        every = max(1, self.sft_total // 10)
        self._refresh(None if step % every else f"warm start {self.sft}")

    def on_step(self, row: dict[str, Any]) -> None:
        self.row = row
        self._refresh(
            f"step {row['step'] + 1}/{self.total} reward {row['reward_mean']:.3f} "
            f"acc {row['accuracy']:.1%} loss {_fmt(row.get('loss'), '+.4f')}"
        )

    def on_eval(self, name: str, result: dict[str, Any]) -> None:
        self.evals[name] = f"{result['accuracy']:.1%} greedy, {result['pass_at_1']:.1%} pass@1"
        self._refresh(f"held-out {name}: {self.evals[name]}")
