"""The trainer process: everything ``swarmrl trainer`` runs once its arguments are parsed.

See :mod:`swarmrl.roles.trainer.cli` for the command line; this module imports torch and
transformers, which the command line does not need for ``--help``.

Under ``torchrun --nproc-per-node N -m swarmrl.cli trainer …`` (or ``[trainer] nproc = N`` in
``swarmrl run``) every rank runs the loop on its shard of the model (FSDP2,
:mod:`swarmrl.trainer.parallel`); rank 0 alone talks to the orchestrator, runs the origin
(:mod:`swarmrl.roles.trainer.origin`), publishes, and writes the status file, the summary and
the run's report (:mod:`swarmrl.roles.trainer.progress`). Checkpoints (:mod:`swarmrl.trainer.checkpoint`) are
saved by every rank after each due step; a restarted trainer resumes from the newest (from the
warm start when there is none) under a new version number (:func:`continue_versions`).

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
from typing import Any

import torch

from swarmrl.config import SwarmConfig
from swarmrl.config.toploc import THRESHOLDS_FILE, lower_dtype_advice
from swarmrl.envs import build_env
from swarmrl.errors import MissingPathError, UserError
from swarmrl.identity import KeyPair, load_keypair
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
from swarmrl.roles.trainer.origin import Origin
from swarmrl.roles.trainer.progress import RunReport, Summary, reporting, role_hooks
from swarmrl.roles.trainer.source import PoolSource
from swarmrl.serving import Tls
from swarmrl.toploc.thresholds import CalibrationPlan, ensure_thresholds, measured_engines
from swarmrl.trainer.checkpoint import Checkpointer
from swarmrl.trainer.learner import Learner, resolve_device
from swarmrl.trainer.loop import Hooks, train
from swarmrl.trainer.parallel import (
    FollowerSource,
    LeaderSource,
    Parallel,
    close_parallel,
    init_parallel,
)
from swarmrl.trainer.trackers import Trackers, tracked

OpenReport = Callable[[SwarmConfig, argparse.Namespace], RunReport]


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
    """Record thresholds calibrated on the starting policy, on every engine the pool accepts
    (``SwarmConfig.pool_engines``), before version 0 is published:
    at ``toploc.thresholds_path`` (where the validators read them), else at
    ``RUN_DIR/toploc-thresholds.json`` for the operator to hand to validators; kept if there,
    unless it misses one of those engines (a one-line :class:`UserError`, before any work)."""
    toploc = config.toploc
    advice = lower_dtype_advice(toploc, config.engine_dtype)
    if advice is not None:
        log.warning(advice)
    if not toploc.calibrate_at_start:
        return
    out = Path(toploc.thresholds_path or run_dir / THRESHOLDS_FILE)
    measured = measured_engines(out)
    if measured is not None:
        missing = [e for e in config.pool_engines if e not in measured]
        if missing:
            raise UserError(
                f"{out} was calibrated on {', '.join(measured)} and the pool accepts "
                f"{', '.join(config.pool_engines)}: remove it to calibrate again, or accept "
                "only the engines it measured (toploc.engines)"
            )
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
        config.engine_dtype,
        out,
        plan=plan,
        cache_dir=config.run.cache_dir,
        topk=toploc.topk,
        engines=config.pool_engines,
        inference=config.inference,
    )
    log.info(
        "verifier thresholds for %s (%s, engines %s) in %.1f s: %s -> %s (validators read it "
        "through toploc.thresholds_path)",
        model_dir,
        config.engine_dtype,
        ", ".join(config.pool_engines),
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
            PoolClient(args.orchestrator, keypair, timeout) as acks,
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
                acks,
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
