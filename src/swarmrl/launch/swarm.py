"""``swarmrl run`` / ``swarmrl demo``: a whole swarm on this machine, each role its own process.

The run directory, and the names, engines and addresses of its roles, come from
``swarmrl.launch.plan``.

Start order: the orchestrator (waited for until it answers), then the trainer, then relays
(each waited for), validators and workers, all while the trainer warms up, calibrates and
publishes version 0 through its origin; then the launcher waits for version 0 (bounded by
``swarm.first_version_timeout_s``, which also bounds how long a worker waits for it). Relays
follow the origin once it is up; workers join the pool and wait for version 0, validators for
work. The roles' own start (interpreter, torch and transformers imports, joining the pool: tens
of seconds when several start at once on a loaded machine) so overlaps the trainer's instead of
delaying step 0. The run ends when the trainer exits after its last step; any other role dying
first ends it with an error that quotes the role's log. Everything is started with the same commands an operator would
type on separate machines (see docs/deploy.md); only the addresses are loopback.

Knows how to wire roles together; nothing about what they compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from swarmrl.config import SwarmConfig
from swarmrl.errors import DiskWriteError, RoleExited, SwarmError, WaitTimeout
from swarmrl.identity import load_keypair
from swarmrl.launch.display import LiveDisplay, StepRows
from swarmrl.launch.facts import POOL_ID, swarm_facts, trainer_summary
from swarmrl.launch.plan import HOST, SwarmPlan, prepare
from swarmrl.launch.report import (
    RESERVE_BYTES,
    RunRecorder,
    RunStatus,
    failure_reason,
    free_bytes,
    full_disk,
)
from swarmrl.protocol.swarm import RoleStatus
from swarmrl.rolekit.supervisor import (
    Supervisor,
    terminate_as_interrupt,
    torchrun_command,
)

# --- starting roles --------------------------------------------------------------------------


def _common(plan: SwarmPlan, name: str) -> list[str]:
    args = [str(plan.config_file), "--name", name, "--status-dir", str(plan.status_dir)]
    # each role serves Prometheus metrics on a free port; its status file names the address
    args += ["--metrics-port", "0"]
    thresholds = plan.config.toploc.thresholds_path
    if thresholds is not None:  # also when the role reads a config file that does not say it
        args += ["--set", f"toploc.thresholds_path={thresholds}"]
    return args


def start_orchestrator(sup: Supervisor, plan: SwarmPlan) -> None:
    args = [
        str(plan.config_file),
        "--key", str(plan.key("orchestrator")),
        "--run-dir", str(plan.run_dir / "orchestrator"),
        "--host", HOST,
        "--port", str(plan.orchestrator_port),
        "--pool", str(plan.run_dir / "pool.json"),
        "--ui-run-dir", str(plan.run_dir),
        "--status-dir", str(plan.status_dir),
    ]  # fmt: skip
    sup.start_role("orchestrator", "orchestrator", args)
    sup.wait_http(
        "orchestrator", f"{plan.orchestrator_url}/health", plan.config.swarm.ready_timeout_s
    )


def start_trainer(
    sup: Supervisor, plan: SwarmPlan, on_wait: Callable[[], None] = lambda: None
) -> None:
    """Start the trainer and wait until its origin lists version 0 (``on_wait`` runs at each
    look: the display shows the warm start meanwhile)."""
    spawn_trainer(sup, plan)
    wait_for_version_0(sup, plan, on_wait)


def spawn_trainer(sup: Supervisor, plan: SwarmPlan) -> None:
    """Start the trainer process without waiting for it (:func:`wait_for_version_0` does)."""
    args = _common(plan, "trainer") + [
        "--key", str(plan.key("trainer")),
        "--orchestrator", plan.orchestrator_url,
        "--pool", POOL_ID,
        "--run-dir", str(plan.run_dir),
        "--origin-host", HOST,
        "--origin-port", str(plan.origin_port),
        "--no-report",  # the launcher writes the run's report (run_swarm)
        # roles share this machine's cores: more threads per role only fight each other
        "--set", f"run.threads={plan.config.swarm.role_threads}",
    ]  # fmt: skip
    nproc = plan.config.trainer.nproc
    if nproc > 1:
        sup.start("trainer", torchrun_command(nproc, "trainer", args))
    else:
        sup.start_role("trainer", "trainer", args)


def wait_for_version_0(
    sup: Supervisor, plan: SwarmPlan, on_wait: Callable[[], None] = lambda: None
) -> None:
    """Wait (``swarm.first_version_timeout_s``) until the trainer's origin lists version 0."""

    def published() -> bool:
        on_wait()
        try:
            import httpx

            return (
                httpx.get(f"{plan.origin_url}/health", timeout=2).json().get("latest") is not None
            )
        except (OSError, ValueError, httpx.HTTPError):
            return False

    sup.wait_ready(
        "trainer",
        published,
        f"the origin at {plan.origin_url} to list version 0 (the warm start may take minutes "
        "the first time; it is cached afterwards)",
        plan.config.swarm.first_version_timeout_s,
    )


def start_relay(sup: Supervisor, plan: SwarmPlan, name: str) -> None:
    trainer_key = load_keypair(plan.key("trainer")).public_key_hex
    args = [
        str(plan.config_file),
        "--name", name,
        "--upstream", plan.origin_url,
        "--publisher-key", trainer_key,
        "--store", str(plan.run_dir / name),
        "--host", HOST,
        "--port", str(plan.relay_ports[name]),
        "--status-dir", str(plan.status_dir),
    ]  # fmt: skip
    sup.start_role(name, "relay", args)
    sup.wait_http(name, f"{plan.relay_url(name)}/health", plan.config.swarm.ready_timeout_s)


def _weights_args(plan: SwarmPlan) -> list[str]:
    trainer_key = load_keypair(plan.key("trainer")).public_key_hex
    out = ["--publisher-key", trainer_key]
    for url in plan.weight_sources:
        out += ["--weights", url]
    return out


def _engine_args(plan: SwarmPlan, name: str) -> list[str]:
    engine = plan.engines.get(name)
    return [] if engine is None else ["--set", f"inference.backend={engine}"]


def start_validator(sup: Supervisor, plan: SwarmPlan, name: str) -> None:
    args = _common(plan, name) + [
        "--key", str(plan.key(name)),
        "--orchestrator", plan.orchestrator_url,
        "--pool", POOL_ID,
        "--work-dir", str(plan.run_dir / name),
    ] + _weights_args(plan) + _engine_args(plan, name)  # fmt: skip
    sup.start_role(name, "validator", args)


def start_worker(sup: Supervisor, plan: SwarmPlan, name: str) -> None:
    args = _common(plan, name) + [
        "--key", str(plan.key(name)),
        "--orchestrator", plan.orchestrator_url,
        "--pool", POOL_ID,
        "--invite", str(plan.run_dir / "invites" / f"{name}.json"),
        "--work-dir", str(plan.run_dir / name),
    ] + _weights_args(plan) + _engine_args(plan, name)  # fmt: skip
    if name in plan.cheats:
        args += ["--set", f"swarm.cheat={plan.cheats[name]}"]
    sup.start_role(name, "worker", args)


def start_all(sup: Supervisor, plan: SwarmPlan, on_wait: Callable[[], None] = lambda: None) -> None:
    """Start every role. Relays, validators and workers start while the trainer warms up and
    calibrates (module docstring), so that they are up by the time version 0 is published and
    step 0's rollouts are generated at once."""
    start_orchestrator(sup, plan)
    spawn_trainer(sup, plan)
    for name in plan.relays:
        start_relay(sup, plan, name)
    for name in plan.validators:
        start_validator(sup, plan, name)
    for name in plan.workers:
        start_worker(sup, plan, name)
    wait_for_version_0(sup, plan, on_wait)


# --- watching --------------------------------------------------------------------------------


# how long the run directory's disk may stay full (under RESERVE_BYTES free) before the run
# fails: long enough for another program's passing burst, short of any role's retry patience
DISK_FULL_S = 3.0


def watch(
    sup: Supervisor,
    plan: SwarmPlan,
    display: LiveDisplay,
    timeout_s: float,
    on_tick: Callable[[dict[str, RoleStatus]], None] | None = None,
) -> None:
    """Redraw the display until the trainer exits 0; a crashed role is started again (bounded,
    see :meth:`Supervisor.tend`); raise if one stays down or time runs out. A role that dies
    while the run directory's disk is full is not started again (it could only die again), and
    a disk that stays full for :data:`DISK_FULL_S` ends the run even while every role still
    lives (they would only retry their writes until their peers' patience runs out): either
    way the run fails with a :class:`DiskWriteError` that says so."""
    deadline = time.monotonic() + timeout_s
    steps = StepRows(plan.run_dir / "trainer" / "steps.jsonl")
    full_since: float | None = None
    while True:
        free = free_bytes(plan.run_dir)
        if free is None or free >= RESERVE_BYTES:
            full_since = None
        elif full_since is None:
            full_since = time.monotonic()
        elif time.monotonic() - full_since >= DISK_FULL_S:
            raise DiskWriteError(
                f"no room left for the run's ledger, status and checkpoints for {DISK_FULL_S:.0f} s"
            )
        trainer = sup.roles["trainer"]  # looked up each time: the trainer may be restarted
        alive = {name: role.alive() for name, role in sup.roles.items()}
        statuses = RoleStatus.read_dir(plan.status_dir)
        title = f"swarmrl · {plan.run_dir}"
        display.update(statuses, alive, plan.config.rl.steps, title, steps.read())
        for name, status in statuses.items():
            if status.state == "banned" and name in sup.roles:
                sup.retire(name)  # a banned worker leaves; the swarm goes on without it
        stop_generating(sup, plan, statuses)
        if on_tick is not None:
            on_tick(statuses)
        if trainer.popen.poll() == 0:
            return
        # workers and validators exit 0 by themselves once the trainer says the run is over
        done = ["trainer", *plan.workers, *plan.validators]
        try:
            sup.check(expected_done=done)
        except RoleExited:  # a role died: started again, unless the disk is full
            free = free_bytes(plan.run_dir)
            if free is not None and free < RESERVE_BYTES:
                raise
        sup.tend(expected_done=done)
        if time.monotonic() > deadline:
            raise WaitTimeout(
                f"gave up after {timeout_s:.0f} s waiting for the trainer to finish "
                f"{plan.config.rl.steps} steps; logs in {sup.log_dir}"
            )
        time.sleep(plan.config.swarm.status_interval_s)


def redraw(display: LiveDisplay, sup: Supervisor, plan: SwarmPlan) -> None:
    """One redraw of the display from the status files, the process table and the trainer's
    step rows."""
    alive = {name: role.alive() for name, role in sup.roles.items()}
    statuses = RoleStatus.read_dir(plan.status_dir)
    steps = StepRows(plan.run_dir / "trainer" / "steps.jsonl").read()
    display.update(statuses, alive, plan.config.rl.steps, f"swarmrl · {plan.run_dir}", steps)


def stop_generating(sup: Supervisor, plan: SwarmPlan, statuses: dict[str, RoleStatus]) -> None:
    """Once the trainer reports RL over, stop the workers and validators: their rollouts can no
    longer be trained on, and they would only compete with the evaluations for the CPU."""
    trainer = statuses.get("trainer")
    if trainer is None or not trainer.metrics.get("rl_done"):
        return
    running = [
        name
        for name in [*plan.workers, *plan.validators]
        if name in sup.roles and name not in sup.retired and sup.roles[name].alive()
    ]
    sup.stop_soon(running)


# --- the whole run ---------------------------------------------------------------------------


def follow_trainer(recorder: RunRecorder, plan: SwarmPlan) -> None:
    """Take the trainer's summary as it stands into ``recorder`` (its loop's result so far)."""
    from swarmrl.trainer.loop import TrainingResult

    training = trainer_summary(plan).get("training")
    if training:
        recorder.result = TrainingResult.from_dict(training)


def run_swarm(
    config: SwarmConfig, run_dir: Path, *, display: bool = True, timeout_s: float = 3600.0
) -> dict:
    """Start a whole local swarm, wait for the trainer to finish, write the report; returns it.

    report.json and metrics.jsonl follow the trainer's summary while the run goes (status
    ``running``). Ctrl-C (or SIGTERM) stops the trainer first, so it records what it finished,
    then the report is written with status ``interrupted`` (``failed`` when a role died, time
    ran out or the run could not start, with the reason) and the error goes on up. When the
    run directory's disk is full, the run fails as a :class:`DiskWriteError` that says so,
    whichever role or write met the full disk first."""
    try:
        plan = prepare(config, run_dir)
    except Exception as exc:
        RunRecorder(config, run_dir, mode="swarm").finish("failed", reason=failure_reason(exc))
        raise
    recorder = RunRecorder(plan.config, plan.run_dir, mode="swarm")
    seen = [0.0]  # mtime of the trainer summary last taken in

    def on_tick(statuses: dict[str, RoleStatus]) -> None:
        path = plan.run_dir / "trainer" / "summary.json"
        if path.is_file() and path.stat().st_mtime != seen[0]:
            seen[0] = path.stat().st_mtime
            follow_trainer(recorder, plan)
            recorder.progress()

    status: RunStatus = "completed"
    reason: str | None = None
    facts: dict = {}
    try:
        with (
            terminate_as_interrupt(),
            LiveDisplay(enabled=display) as live,
            Supervisor(
                run_dir,
                config.swarm.shutdown_grace_s,
                config.swarm.max_restarts,
                config.swarm.restart_backoff_s,
            ) as sup,
        ):
            try:
                start_all(sup, plan, lambda: redraw(live, sup, plan))
                watch(sup, plan, live, timeout_s, on_tick)
            except KeyboardInterrupt:
                status = "interrupted"
                raise
            except BaseException as exc:
                status = "failed"
                full = full_disk(plan.run_dir, exc)
                reason = failure_reason(full or exc)
                if full is not None:
                    raise full from exc
                raise
            finally:
                if status != "completed" and "trainer" in sup.roles:
                    sup.stop("trainer")  # it writes what it finished into its summary
                facts = _facts_if_reachable(plan, status)
    finally:
        follow_trainer(recorder, plan)
        report = recorder.finish(status, facts, reason)
    return report


def _facts_if_reachable(plan: SwarmPlan, status: str) -> dict:
    """The swarm's facts; after an early end, ``{}`` when the orchestrator cannot give them."""
    import httpx

    if status == "completed":
        return swarm_facts(plan)
    try:
        return swarm_facts(plan)
    except (OSError, SwarmError, httpx.HTTPError):
        return {}


# `swarmrl demo`: the embedded config as a swarm, plus one worker that starts cheating after
# three honest submissions, to show it being caught, banned and kept out of training. The SFT
# control costs about as much as the RL it controls for, so the demo runs it only on request
# (`--set eval.control=true`); its report says so under eval.control_skipped.
DEMO_OVERRIDES = ("swarm.cheaters=['corrupt_weights_after:3']", "eval.control=false")
