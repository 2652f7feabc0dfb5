"""What the training loop's progress does to the trainer role's outputs: its log, its status
file, ``RUN_DIR/trainer/steps.jsonl`` and ``summary.json``, the trained policy once RL ends, and
the run directory's report of a trainer started by hand (:class:`RunReport`).

Each output is one set of :class:`~swarmrl.trainer.loop.Hooks` that the process
(:mod:`swarmrl.roles.trainer.process`) chains with its checkpointing. Knows nothing about how
versions are published or batches fetched: it reads the counts the origin and the source keep.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from swarmrl.errors import DiskWriteError
from swarmrl.model.io import save_policy
from swarmrl.rolekit.toolkit import StatusReporter
from swarmrl.roles.trainer.origin import Origin
from swarmrl.roles.trainer.source import PoolSource
from swarmrl.shardcast.publisher import WRITE_FAULTS
from swarmrl.trainer.learner import Learner
from swarmrl.trainer.loop import STATUS_KEYS, Hooks, TrainingResult


class RunReport(Protocol):
    """The run directory's report as the trainer's loop goes (``swarmrl.launch.handrun``)."""

    def follow(self, result: TrainingResult, history: list[dict[str, Any]]) -> None:
        """The loop's result as it fills in, and every step's row (``history``: after a
        resume, the loop's result holds only the steps since)."""

    def step(self, row: dict[str, Any]) -> None:
        """One step's row (metrics.jsonl), then report.json with status ``running``."""

    def progress(self) -> None:
        """report.json with status ``running`` (after an evaluation)."""

    def end(self, status: str, error: BaseException | None = None) -> None:
        """The final report.json and report.png: ``completed``, ``interrupted`` or ``failed``
        (``error`` says why), with the pool's closing account where it can be had."""


def role_hooks(
    log: logging.Logger,
    status: StatusReporter,
    steps_file: Path,
    history: list[dict[str, Any]],
    summary: Summary,
    policy_dir: Path,
) -> Hooks:
    """What the loop's progress does to this role's log, status file, ``steps_file`` (one
    JSON line per step as it ends) and summary; rows also go to ``history``, which holds the
    rows of the steps before a resume; ``policy_dir`` gets the policy once RL ends."""
    waited = [0.0, 0.0]  # seconds waiting for rollouts, seconds in steps
    control_began = [0.0]  # monotonic clock when the control arm began
    # a new file put in place whole: a reader following the old one by its offset sees it
    # replaced (another inode), never a shorter history rewritten under its offset
    scratch = steps_file.with_name(f".{steps_file.name}.tmp")
    scratch.write_text("".join(json.dumps(row) + "\n" for row in history))
    os.replace(scratch, steps_file)

    def on_step(row: dict[str, Any]) -> None:
        history.append(row)
        with steps_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        waited[0] += row["rollout_s"]
        waited[1] += row["rollout_s"] + row["update_s"]
        status.set(
            step=row["step"] + 1,
            reward_mean=row["reward_mean"],
            accuracy_rollouts=row["accuracy"],
            idle_fraction=waited[0] / max(waited[1], 1e-9),
            **{k: row[k] for k in STATUS_KEYS if row[k] is not None},
        )
        status.add(idle_seconds=row["rollout_s"], update_seconds=row["update_s"])
        rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
        log.info("step %d: %s", row["step"], json.dumps(rounded))
        summary.write("running")

    def on_eval(name: str, result: dict[str, Any]) -> None:
        if name == "control":
            log.info(
                "control done: %d SFT steps in its %.1f s, evaluated; %.1f s in all",
                result.get("sft_steps", 0),
                summary.result.control_seconds or 0.0,
                time.monotonic() - control_began[0],
            )
        log.info("held-out %s: accuracy %.3f", name, result["accuracy"])
        if name != "control":
            # the RL steps trained when it ran: the console labels it with this, not with the
            # steps it has seen by the time it reads the status (launch.display)
            status.set(accuracy=result["accuracy"], eval_after_steps=len(history))
            status.add(evals=1)  # the console tells each evaluation once (launch.display)
        summary.write("running")

    def on_rl_end(learner: Learner) -> None:
        save_policy(learner.policy, learner.tokenizer, policy_dir)
        status.set(rl_done=1)
        status.event(f"RL finished; policy saved to {policy_dir}")
        log.info("RL finished; trained policy saved to %s", policy_dir)
        summary.write("running")

    def on_phase(phase: str) -> None:
        status.set(state=phase)
        if phase == "rl":
            summary.flow.setdefault("rl_started_at", time.time())
        if phase == "control":
            control_began[0] = time.monotonic()
            result = summary.result
            log.info(
                "control: the warm start's SFT continued for %.1f s (RL's %.1f s less %.1f s "
                "waiting for rollouts), then evaluated (eval.control=false skips it)",
                result.control_seconds or 0.0,
                result.rl_seconds,
                result.rl_seconds - (result.control_seconds or 0.0),
            )

    return Hooks(
        on_phase=on_phase,
        on_step=on_step,
        on_eval=on_eval,
        on_start=summary.follow,
        on_rl_end=on_rl_end,
    )


def reporting(hooks: Hooks, report: RunReport, history: list[dict[str, Any]]) -> Hooks:
    """``hooks``, then the same progress into the run directory's ``report``; ``history``
    holds every step's row (``hooks`` append to it), the steps before a resume included."""

    def on_start(result: TrainingResult) -> None:
        hooks.on_start(result)
        report.follow(result, history)

    def on_step(row: dict[str, Any]) -> None:
        hooks.on_step(row)
        report.step(row)

    def on_eval(name: str, result: dict[str, Any]) -> None:
        hooks.on_eval(name, result)
        report.progress()

    return replace(hooks, on_start=on_start, on_step=on_step, on_eval=on_eval)


class Summary:
    """``RUN_DIR/trainer/summary.json``, rewritten as the run goes: ``status``, the loop's
    result (``training``: the same record a colocated run reports), the seconds since the
    trainer started (``wall_seconds``), what the origin published (``origin``), the submissions
    trained on, and when versions and acknowledgements went out (``flow``). After a resume the loop's own history holds
    only the steps since; ``history`` holds them all."""

    def __init__(self, path: Path, origin: Origin, started: float | None = None) -> None:
        self.path, self.origin = path, origin
        self.started = time.monotonic() if started is None else started
        self.result = TrainingResult()
        self.source: PoolSource | None = None
        self.history: list[dict[str, Any]] | None = None
        # the run over time (swarmrl.launch.flow): rl_started_at (Unix s), versions
        # [(Unix s, version)] as announced, acks [(Unix s, submissions acknowledged)],
        # stale_dropped [submission ids acknowledged with every group dropped as too stale];
        # forged [submission ids whose episodes failed the trainer's recomputation: untrained];
        # written with stale_groups (informative groups held over that went too stale)
        self.flow: dict[str, Any] = {}

    def follow(self, result: TrainingResult) -> None:
        self.result = result

    def write(self, status: str) -> None:
        summary = {
            "status": status,
            "wall_seconds": time.monotonic() - self.started,
            "training": self.result.to_dict()
            | ({"history": self.history} if self.history is not None else {}),
            "origin": {
                "versions_published": len(self.origin.versions),
                "bytes_full": self.origin.bytes_full,
                "bytes_delta": self.origin.bytes_delta,
            },
            "consumed_submissions": self.source.consumed if self.source else [],
            "flow": {k: list(v) if isinstance(v, list) else v for k, v in self.flow.items()}
            | ({"stale_groups": self.source.stale_groups} if self.source else {}),
        }
        scratch = self.path.with_suffix(".json.partial")
        try:
            scratch.write_text(json.dumps(summary, indent=2) + "\n")
            scratch.replace(self.path)
        except OSError as exc:
            scratch.unlink(missing_ok=True)  # a full disk leaves no empty file behind
            if exc.errno in WRITE_FAULTS:
                raise DiskWriteError(f"writing {self.path} failed: {exc}") from exc
            raise
