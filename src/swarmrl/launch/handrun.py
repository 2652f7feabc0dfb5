"""A run deployed by hand gets the run directory ``swarmrl run`` writes: ``swarmrl trainer``
and ``swarmrl report``.

``swarmrl trainer …`` (docs/deploy.md) runs the trainer role (``swarmrl.roles.trainer``) and
hands it a :class:`HandRunReport`, which writes ``RUN_DIR/config.json``, ``metrics.jsonl``,
``report.json`` and ``report.png`` as the run goes (``swarmrl.launch.report``), and at the end
the pool's closing account (``swarmrl.launch.facts``: submissions, verdicts, bans, the ledger
exported to ``ledger.jsonl`` and verified) asked of the orchestrator with the trainer's key, the
pool owner's; the summary ``swarmrl run`` prints is printed too. Under ``swarmrl run`` the
trainer gets ``--no-report``: the launcher writes those files itself.

``swarmrl report RUN_DIR [--orchestrator URL --key OWNER_KEY]`` builds the same files after the
fact from what the trainer wrote (``RUN_DIR/trainer/summary.json``, ``RUN_DIR/config.json``) and,
where an orchestrator is named, the pool's facts as they stand now; without one, the pool's
facts already in report.json are kept.

Knows how to find a hand-deployed run's parts from the trainer's arguments; nothing about
training or the pool's inner workings.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from swarmrl.config import SwarmConfig, load_config
from swarmrl.errors import MissingPathError, SwarmError, UserError
from swarmrl.identity import load_keypair
from swarmrl.launch.facts import POOL_ID, summary_text, swarm_facts
from swarmrl.launch.plan import SwarmPlan
from swarmrl.launch.report import RunRecorder, RunStatus, failure_reason
from swarmrl.trainer.loop import TrainingResult

log = logging.getLogger(__name__)

SUMMARY = Path("trainer") / "summary.json"


@dataclass
class HandPlan(SwarmPlan):
    """A run's parts as a hand deployment names them: the orchestrator's URL, the pool owner's
    key file and the pool; the orchestrator's public key pinned, or asked of its ``/health``.
    Worker names and planted cheats are known only for a run directory ``swarmrl run`` made
    (its ``keys/worker-N.key``)."""

    url: str = ""
    owner_key: Path = Path()
    orchestrator_key: str | None = None
    statuses: Path | None = None

    def __post_init__(self) -> None:
        keys = sorted(
            (self.run_dir / "keys").glob("worker-*.key"), key=lambda p: int(p.stem.split("-")[1])
        )
        self.workers = [p.stem for p in keys]
        honest = self.config.swarm.workers
        if len(self.workers) == honest + len(self.config.swarm.cheaters):
            self.cheats = {
                self.workers[honest + i]: c for i, c in enumerate(self.config.swarm.cheaters)
            }

    def key(self, name: str) -> Path:
        return self.owner_key if name == "trainer" else super().key(name)

    def orchestrator_public_key(self) -> str:
        if self.orchestrator_key is None:
            import httpx

            health = httpx.get(f"{self.url}/health", timeout=self.config.swarm.peer_timeout_s)
            self.orchestrator_key = str(health.json()["orchestrator_key"])
        return self.orchestrator_key

    @property
    def orchestrator_url(self) -> str:
        return self.url

    @property
    def status_dir(self) -> Path:
        return self.statuses if self.statuses is not None else self.run_dir / "status"


def pool_facts(plan: HandPlan) -> dict[str, Any]:
    """The pool's closing account, or ``{}`` (with a warning saying how to get it later) when
    the orchestrator cannot give it."""
    import httpx

    try:
        return swarm_facts(plan)
    except (OSError, SwarmError, httpx.HTTPError, KeyError, ValueError) as exc:
        log.warning(
            "the report has no pool facts: the orchestrator at %s did not give them (%s); add "
            "them later with `swarmrl report %s --orchestrator URL --key OWNER_KEY`",
            plan.url,
            failure_reason(exc),
            plan.run_dir,
        )
        return {}


class HandRunReport:
    """The trainer's :class:`~swarmrl.roles.trainer.progress.RunReport` for a hand-started run."""

    def __init__(self, config: SwarmConfig, args: argparse.Namespace) -> None:
        run_dir = Path(args.run_dir)
        self.recorder = RunRecorder(config, run_dir, mode="swarm")
        self.result = TrainingResult()
        self.history: list[dict[str, Any]] = []
        self.plan = HandPlan(
            config,
            run_dir,
            run_dir / "config.toml",
            pool_id=args.pool,
            url=args.orchestrator.rstrip("/"),
            owner_key=Path(args.key),
            statuses=Path(args.status_dir) if args.status_dir else None,
        )

    def follow(self, result: TrainingResult, history: list[dict[str, Any]]) -> None:
        self.result, self.history = result, history
        self.progress()

    def step(self, row: dict[str, Any]) -> None:
        self.progress()

    def progress(self) -> None:
        self._take()
        self.recorder.progress()

    def _take(self) -> None:
        """The loop's result with every step's row, a restarted trainer's earlier ones too."""
        self.recorder.result = replace(self.result, history=list(self.history))

    def end(self, status: str, error: BaseException | None = None) -> None:
        self._take()
        facts = pool_facts(self.plan)
        reason = None if error is None or status != "failed" else failure_reason(error)
        report = self.recorder.finish(_status(status), facts, reason)
        if status == "completed" and facts:
            print(summary_text(report) + f"\nrun directory: {self.recorder.dir}", flush=True)
        log.info("report in %s", self.recorder.dir / "report.json")


def _status(status: str) -> RunStatus:
    if status not in ("running", "completed", "interrupted", "failed"):
        raise ValueError(f"not a run status: {status!r}")
    return status  # type: ignore[return-value]


# --- swarmrl report --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmrl report",
        description="write report.json, report.png and metrics.jsonl of a run from what its "
        "trainer wrote (a trainer started by hand, or a run to report again)",
    )
    parser.add_argument("run_dir", help="the run directory (the trainer's --run-dir)")
    parser.add_argument("--orchestrator", help="orchestrator URL: add the pool's facts now")
    parser.add_argument("--key", help="the pool owner's key file (the trainer's --key)")
    parser.add_argument("--pool", default=POOL_ID, help="pool id")
    parser.add_argument(
        "--orchestrator-key", help="orchestrator public key, hex (default: its /health says)"
    )
    parser.add_argument("--config", help="the run's config (default: RUN_DIR/config.json)")
    parser.add_argument("--status-dir", help="the roles' status files (default: RUN_DIR/status)")
    return parser


def _run_config(run_dir: Path, given: str | None) -> SwarmConfig:
    if given is not None:
        return load_config([given])
    path = run_dir / "config.json"
    if not path.is_file():
        raise MissingPathError(f"{path} not found: name the run's config with --config FILE")
    return SwarmConfig.model_validate(json.loads(path.read_text()))


def build_report(args: argparse.Namespace) -> dict[str, Any]:
    """report.json (and its plot and metrics) of ``args.run_dir``; returns the report."""
    run_dir = Path(args.run_dir)
    summary_file = run_dir / SUMMARY
    old_file = run_dir / "report.json"
    old = json.loads(old_file.read_text()) if old_file.is_file() else {}
    if not summary_file.is_file() and old.get("mode") == "colocated":
        raise UserError(
            f"{run_dir} is a colocated run: `swarmrl run --colocated` wrote its report.json "
            "itself, and there is no trainer summary to build one from"
        )
    if not summary_file.is_file():
        raise MissingPathError(
            f"{summary_file} not found: RUN_DIR is the --run-dir a trainer was started with"
        )
    if args.orchestrator and not args.key:
        raise UserError(
            "--orchestrator needs --key: the orchestrator tells a pool's metrics and nodes only "
            "to its owner (the trainer's key)"
        )
    summary = json.loads(summary_file.read_text())
    config = _run_config(run_dir, args.config)
    if args.orchestrator:
        plan = HandPlan(
            config,
            run_dir,
            run_dir / "config.toml",
            pool_id=args.pool,
            url=args.orchestrator.rstrip("/"),
            owner_key=Path(args.key),
            orchestrator_key=args.orchestrator_key,
            statuses=Path(args.status_dir) if args.status_dir else None,
        )
        load_keypair(plan.owner_key)  # a missing or unreadable key file: one line, now
        facts = swarm_facts(plan)
    else:  # the pool's facts already reported stay
        facts = {k: old[k] for k in ("swarm", "shardcast", "ledger") if k in old}
    recorder = RunRecorder(config, run_dir, mode=old.get("mode", "swarm"))
    recorder.result = TrainingResult.from_dict(summary["training"])
    wall = summary.get("wall_seconds", old.get("wall_seconds", 0.0))
    recorder.started = time.monotonic() - wall
    reason = old.get("reason") if summary["status"] == "failed" else None
    return recorder.finish(_status(summary["status"]), facts, reason)


def main(verb: str, argv: Sequence[str]) -> int:
    if verb == "trainer":
        from swarmrl.roles.trainer import cli as trainer_cli

        return trainer_cli.main(verb, argv, HandRunReport)
    args = _parser().parse_args(list(argv))
    report = build_report(args)
    run_dir = Path(args.run_dir)
    print(
        f"{report['status']}: {report['steps']} steps; report in {run_dir / 'report.json'} "
        f"and {run_dir / 'report.png'}"
    )
    if report["status"] == "completed" and "swarm" in report:
        print(summary_text(report))
    return 0
