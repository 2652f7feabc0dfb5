"""The trainer process: everything ``swarmrl trainer`` runs once its arguments are parsed.

See :mod:`swarmrl.roles.trainer.cli` for the command line; this module imports torch and
transformers, which the command line does not need for ``--help``.

Under ``torchrun --nproc-per-node N -m swarmrl.cli trainer …`` (or ``[trainer] nproc = N`` in
``swarmrl run``) every rank runs the loop on its shard of the model (FSDP2,
:mod:`swarmrl.trainer.parallel`); rank 0 alone talks to the orchestrator, runs the origin,
publishes, and writes the status file, the summary and the run's report. Checkpoints (:mod:`swarmrl.trainer.
checkpoint`) are saved by every rank after each due step; a restarted trainer resumes from the
newest (from the warm start when there is none) under a new version number
(:func:`continue_versions`).

A trainer started by hand also writes the run directory ``swarmrl run`` writes (config.json,
metrics.jsonl, report.json, report.png, ledger.jsonl) through a :class:`RunReport` its command
line is handed (``swarmrl.launch.handrun``: this layer may not import the launcher's); under
``swarmrl run`` the launcher writes them and the trainer gets none.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from swarmrl.config import SwarmConfig
from swarmrl.config.toploc import THRESHOLDS_FILE
from swarmrl.envs import build_env
from swarmrl.errors import DiskWriteError, MissingPathError
from swarmrl.identity import KeyPair, load_keypair
from swarmrl.model.io import save_policy
from swarmrl.pool.client import PoolClient
from swarmrl.rolekit.metrics import serve_role_metrics
from swarmrl.rolekit.supervisor import die_with_parent, terminate_as_interrupt
from swarmrl.rolekit.toolkit import (
    StatusReporter,
    load_role_config,
    log_config,
    setup_logging,
)
from swarmrl.roles.trainer.announce import Announcer
from swarmrl.roles.trainer.source import PoolSource
from swarmrl.serving import Tls
from swarmrl.shardcast import Publisher, store
from swarmrl.shardcast.catalog import Catalog
from swarmrl.shardcast.publisher import WRITE_FAULTS
from swarmrl.shardcast.server import build_app, serve_in_thread
from swarmrl.toploc.thresholds import CalibrationPlan, ensure_thresholds
from swarmrl.trainer.checkpoint import Checkpointer
from swarmrl.trainer.learner import Learner, resolve_device
from swarmrl.trainer.loop import STATUS_KEYS, Hooks, TrainingResult, train
from swarmrl.trainer.parallel import (
    FollowerSource,
    LeaderSource,
    Parallel,
    close_parallel,
    init_parallel,
)
from swarmrl.trainer.trackers import Trackers, tracked


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


OpenReport = Callable[[SwarmConfig, argparse.Namespace], RunReport]


class Origin:
    """The publisher and the HTTP origin serving its store."""

    def __init__(
        self,
        store_dir: Path,
        keypair: KeyPair,
        config: SwarmConfig,
        host: str,
        port: int,
        tls: Tls | None = None,
    ) -> None:
        self.store_dir = store_dir
        store.discard_stale_partials(store_dir)  # a killed trainer's unfinished version
        self.publisher = Publisher(store_dir, keypair, config.shardcast)
        catalog = Catalog(store_dir, config.shardcast.keep_versions)
        catalog.refresh()
        self.server = serve_in_thread(
            build_app(catalog, config.shardcast, role="origin", watch_disk=True),
            host,
            port,
            tls=tls,
        )
        self.bytes_full = 0
        self.bytes_delta = 0
        self.versions: list[int] = []

    def publish(self, save: Callable[[Path], Path], version: int, scratch: Path) -> None:
        """Save (``save(dir)``: a snapshot of the whole policy, or the base and a LoRA
        adapter), shard, sign and serve ``version``; the checkpoint copy is removed afterwards."""
        checkpoint = save(scratch / f"v{version}")
        manifest = self.publisher.publish(checkpoint, version, version)
        self.bytes_full += manifest.total_bytes
        self.bytes_delta += sum(d.size for d in manifest.deltas)
        self.versions.append(version)
        shutil.rmtree(checkpoint)

    def stop(self) -> None:
        self.server.stop()


def start(args: argparse.Namespace, open_report: OpenReport | None = None) -> int:
    """Run the role with parsed arguments (see :mod:`cli`); returns the exit status.
    ``open_report`` makes the run directory's report (a trainer started by hand)."""
    config = load_role_config(args)
    keypair = load_keypair(args.key)  # before the first log line: a refusal is one line
    name = args.name or "trainer"
    log = setup_logging(name)
    log_config(log, config)
    torch.set_num_threads(config.run.threads)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun starts each rank in a session of its own: if torchrun itself is killed, its
        # ranks must not train on beside the trainer started in its place
        die_with_parent(signal.SIGKILL)
        if os.getppid() == 1:
            return 1  # torchrun was already gone
    leader = os.environ.get("RANK", "0") == "0"  # other torchrun ranks keep no status file
    status_dir = args.status_dir if leader else None
    status = StatusReporter("trainer", name, status_dir, config.swarm.status_interval_s)
    if leader:
        serve_role_metrics(status, args, log)
    with terminate_as_interrupt(), status:
        rows = config.rl.prompts_per_step * config.rl.group_size
        parallel = init_parallel(resolve_device(config.run.device), config.trainer, rows)
        try:
            checkpoints, latest = find_checkpoint(args, config, parallel)
            if not parallel.leader:
                return follow(config, parallel, checkpoints, latest)
            report = open_report(config, args) if open_report is not None else None
            return run(args, config, keypair, log, status, parallel, checkpoints, latest, report)
        except KeyboardInterrupt:
            log.info("stopping")
            return 130
        finally:
            close_parallel(parallel)


def find_checkpoint(
    args: argparse.Namespace, config: SwarmConfig, parallel: Parallel
) -> tuple[Checkpointer, Path | None]:
    """The run's checkpointer and the checkpoint to resume (checked before anything is
    written: a mismatch or a missing ``--resume`` checkpoint stops the role at start)."""
    root = config.trainer.checkpoint_dir or Path(args.run_dir) / "trainer" / "checkpoints"
    checkpoints = Checkpointer(Path(root), config, parallel)
    latest = checkpoints.latest()
    if args.resume and latest is None:
        raise MissingPathError(f"--resume: no checkpoint in {root}")
    return checkpoints, latest


def checkpointing(
    hooks: Hooks,
    checkpoints: Checkpointer,
    learner: Learner,
    last_step: int,
    extra: Callable[[], Any],
    on_last: Callable[[], None] = lambda: None,
) -> Hooks:
    """``hooks`` plus a checkpoint after each step that is due (every rank saves its part);
    ``on_last`` runs once the last step's checkpoint is saved."""

    def on_step(row: dict[str, Any]) -> None:
        hooks.on_step(row)
        done = row["step"] + 1
        if checkpoints.due(done, last_step):
            learner.save_checkpoint(checkpoints, done, extra())
        if done == last_step:
            on_last()

    return replace(hooks, on_step=on_step)


def follow(
    config: SwarmConfig, parallel: Parallel, checkpoints: Checkpointer, latest: Path | None
) -> int:
    """A rank other than 0: the same loop on its shard, over the leader's broadcast batches."""
    learner = Learner(config, build_env(config.env), parallel=parallel)
    if latest is not None:
        learner.resume(checkpoints, latest)
    hooks = checkpointing(Hooks(), checkpoints, learner, config.rl.steps, lambda: None)
    train(config, learner, FollowerSource(parallel), hooks)
    return 0


def calibrate_verifier(
    config: SwarmConfig,
    model_dir: Path,
    run_dir: Path,
    status: StatusReporter,
    log: logging.Logger,
) -> None:
    """Record thresholds calibrated on the starting policy before version 0 is published:
    at ``toploc.thresholds_path`` (where the validators read them), else at
    ``RUN_DIR/toploc-thresholds.json`` for the operator to hand to validators; kept if there."""
    toploc = config.toploc
    if not toploc.calibrate_at_start:
        return
    out = Path(toploc.thresholds_path or run_dir / THRESHOLDS_FILE)
    if out.is_file():
        return
    status.set(state="calibrating the verifier")
    s = config.rl.sampling
    plan = CalibrationPlan(
        samples=toploc.calibration_samples,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
    )
    started = time.monotonic()
    document = ensure_thresholds(
        model_dir,
        config.model.dtype,
        out,
        plan=plan,
        cache_dir=config.run.cache_dir,
        topk=toploc.topk,
    )
    log.info(
        "verifier thresholds for %s (%s) in %.1f s: %s -> %s (validators read it through "
        "toploc.thresholds_path)",
        model_dir,
        config.model.dtype,
        time.monotonic() - started,
        json.dumps(document["thresholds"]),
        out,
    )


def run(
    args: argparse.Namespace,
    config: SwarmConfig,
    keypair: KeyPair,
    log: logging.Logger,
    status: StatusReporter,
    parallel: Parallel,
    checkpoints: Checkpointer,
    latest: Path | None,
    report: RunReport | None = None,
) -> int:
    """Warm start, calibrate, publish version 0, train; ``summary.json`` (and ``report``'s
    files) are written after every step and evaluation (``status``: running, then completed,
    interrupted or failed) and ``RUN_DIR/policy/`` as soon as RL is over."""
    try:
        code = _run(args, config, keypair, log, status, parallel, checkpoints, latest, report)
    except KeyboardInterrupt as exc:
        if report is not None:
            report.end("interrupted", exc)
        raise
    except BaseException as exc:
        if report is not None:
            report.end("failed", exc)
        raise
    if report is not None:
        report.end("completed")
    return code


def _run(
    args: argparse.Namespace,
    config: SwarmConfig,
    keypair: KeyPair,
    log: logging.Logger,
    status: StatusReporter,
    parallel: Parallel,
    checkpoints: Checkpointer,
    latest: Path | None,
    report: RunReport | None,
) -> int:
    started = time.monotonic()
    run_dir = Path(args.run_dir)
    work = run_dir / "trainer"
    work.mkdir(parents=True, exist_ok=True)
    for leftover in work.glob("v[0-9]*"):  # snapshots a killed trainer had not published
        shutil.rmtree(leftover, ignore_errors=True)
    env = build_env(config.env)
    status.set(state="warm start", sft_steps=config.sft.steps)
    learner = Learner(
        config,
        env,
        lambda step, loss: status.set(sft_step=step, sft_loss=loss),
        parallel=parallel,
    )
    if parallel.sharded:
        log.info("rank 0 of %d (FSDP2 on %s)", parallel.world, parallel.device)
    saved: dict[str, Any] = {"source": None, "history": []}
    if latest is not None:
        saved = learner.resume(checkpoints, latest).source_state
        log.info(
            "resumed from %s: step %d, version %d", latest, learner.first_step, learner.version
        )
    warm = learner.warm
    log.info("warm start %s (%s)", warm.path, "cached" if warm.cached else f"{warm.seconds:.0f} s")
    calibrate_verifier(config, warm.path, run_dir, status, log)
    tls = Tls.from_flags(args.tls_cert, args.tls_key)
    origin = Origin(work / "origin", keypair, config, args.origin_host, args.origin_port, tls)
    log.info("origin serving %s at %s", origin.store_dir, origin.server.url)
    summary = Summary(work / "summary.json", origin, started)
    closing: list[Callable[[], None]] = []  # background threads to stop, last started first
    try:
        timeout = config.swarm.peer_timeout_s
        with (
            PoolClient(args.orchestrator, keypair, timeout) as pool,
            PoolClient(args.orchestrator, keypair, timeout) as publishing,
        ):
            announce = Announcer(origin, publishing, args.pool, learner, work, config, log, status)
            # the orchestrator hears that the run is over only once the last step's checkpoint
            # is saved (``on_last`` below): a trainer killed before then trains that step
            # again, which needs rollouts, and the pool of a finished run leases no more work
            source = PoolSource(
                pool,
                args.pool,
                env,
                learner.tokenizer,
                config,
                log,
                status,
                lambda version, final: announce(version),
            )
            closing.extend([source.close, announce.close])
            continue_versions(learner, origin, source, announce, log, latest is not None)
            if latest is not None:
                source.restore(saved["source"])
            history: list[dict[str, Any]] = list(saved["history"])
            summary.source, summary.history = source, history
            summary.flow = {
                "versions": announce.published,
                "acks": source.acks,
                "stale_dropped": source.stale_dropped,
                "forged": source.forged,
            }
            hooks = role_hooks(
                log, status, work / "steps.jsonl", history, summary, run_dir / "policy"
            )
            if report is not None:
                hooks = reporting(hooks, report, history)
            hooks = checkpointing(
                hooks,
                checkpoints,
                learner,
                config.rl.steps,
                lambda: {"source": source.state(), "history": list(history)},
                lambda: announce(learner.version, final=True),
            )
            with Trackers(config, run_dir) as trackers:
                leading = LeaderSource(source, parallel)
                # the control runs in this process alone: the waits for the pool are no part
                # of the time it is owed
                train(config, learner, leading, tracked(hooks, trackers), True)
            summary.write("completed")
            status.set(state="done")
            log.info(
                "run finished: %d steps; policy in %s, summary in %s",
                summary.result.steps,
                run_dir / "policy",
                summary.path,
            )
    except KeyboardInterrupt:
        summary.write("interrupted")
        raise
    except BaseException:
        summary.write("failed")
        raise
    finally:
        for close in reversed(closing):
            close()
        origin.stop()
        learner.close()
    return 0


def continue_versions(
    learner: Learner,
    origin: Origin,
    source: PoolSource,
    announce: Announcer,
    log: logging.Logger,
    resumed: bool,
) -> None:
    """Publish the version the loop starts from: version 0 for a run's first trainer; for a
    trainer started again after it died at any moment (``resumed``: from a checkpoint, else
    from the warm start), a version number nobody has seen yet.

    A version names one set of weights, and relays and workers refuse to go back to an older
    one. The killed trainer may have published versions past its checkpoint (the steps after
    it, lost with the process; without a checkpoint, every step), and told the orchestrator a
    version whose weights never went out. The weights the trainer resumes with are therefore
    published as one past the newest version the origin or the orchestrator holds, and the run
    goes on from there: its versions then run ahead of its steps by ``version_offset``, which
    the announcer adds to the run's last version it tells the orchestrator and the source to
    the step it asks batches for, so that both keep counting staleness in versions. Only a
    checkpoint of the newest version, both published and told, goes on under its own number
    (told again: idempotent)."""
    published = origin.publisher.latest()
    told = announce.told()
    newest = told if published is None else max(told, published)
    if resumed and published == told == learner.version:
        version = learner.version
    elif not resumed and published is None and told == 0:
        version = 0  # the run's first trainer (or one killed before version 0 went out)
    else:
        version = newest + 1
        log.info(
            "started again from %s; the origin holds up to %s and the orchestrator was told "
            "v%d: the weights go out as v%d, and the run goes on from there",
            f"the checkpoint after step {learner.first_step} (v{learner.version})"
            if resumed
            else "the warm start (no checkpoint yet)",
            "nothing" if published is None else f"v{published}",
            told,
            version,
        )
    learner.version = version
    announce.version_offset = source.version_offset = version - learner.first_step
    source.announced = version
    if version != told or version != published:
        announce(version)
        announce.wait()
    # resumed from the last step's checkpoint: the loop has no step left whose commit would
    # tell the orchestrator that the run is over
    announce.tell(version, finished=learner.first_step >= announce.config.rl.steps)


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
    with steps_file.open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in history)

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
