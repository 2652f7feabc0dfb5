"""A real swarm on loopback: every role its own process, a cheater caught, faults survived.

The runs are short (a tiny task and model, a few steps); they check the wiring, not learning
quality (that is the demo's bar). Each run is bounded: ``run_swarm``/``watch`` raise when the
trainer has not finished in time, and every role is stopped whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import sqlalchemy as sa

from swarmrl.config import EMBEDDED_DEFAULT, load_config
from swarmrl.errors import PeerUnavailable
from swarmrl.identity import load_keypair
from swarmrl.launch.display import LiveDisplay
from swarmrl.launch.facts import POOL_ID, summary_text, swarm_facts
from swarmrl.launch.plan import prepare
from swarmrl.launch.swarm import run_swarm, start_all, watch
from swarmrl.pool.client import PoolClient
from swarmrl.pool.state.db import make_engine, sqlite_url
from swarmrl.rolekit.supervisor import Supervisor, wait_until
from swarmrl.trainer.loop import ROW_KEYS

pytestmark = pytest.mark.slow

TINY = [
    "env.digits=1",
    "model.tiny.hidden_size=64",
    "model.tiny.num_layers=2",
    "model.tiny.intermediate_size=128",
    "sft.steps=60",
    "sft.batch_size=64",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "rl.max_backfill_rounds=0",
    "eval.n=20",
    "eval.control=false",
    "swarm.rollouts_per_lease=8",
    "swarm.ready_timeout_s=120",
    "swarm.give_up_s=90",
    "swarm.batch_timeout_s=120",
    "swarm.shutdown_grace_s=5",
    "eval.every=100",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One warm start shared by the runs of this module."""
    return tmp_path_factory.mktemp("cache")


def _config(cache_dir: Path, *extra: str):
    return load_config([EMBEDDED_DEFAULT], [*TINY, f"run.cache_dir={cache_dir}", *extra])


def _submissions(run_dir: Path) -> dict[str, tuple[str, str, int | None]]:
    """submission id → (node id, status, consumed step) from the orchestrator's database."""
    engine = make_engine(sqlite_url(run_dir / "orchestrator" / "pool.db"))
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("select submission_id, node_id, status, consumed_step from submissions")
            ).all()
    finally:
        engine.dispose()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def _active_leases(run_dir: Path, node_id: str) -> int:
    engine = make_engine(sqlite_url(run_dir / "orchestrator" / "pool.db"))
    try:
        with engine.connect() as conn:
            return conn.execute(
                sa.text("select count(*) from leases where node_id = :n and state = 'active'"),
                {"n": node_id},
            ).scalar_one()
    except sa.exc.OperationalError:  # tables not created yet
        return 0
    finally:
        engine.dispose()


def _reassigned(run_dir: Path) -> int:
    engine = make_engine(sqlite_url(run_dir / "orchestrator" / "pool.db"))
    try:
        with engine.connect() as conn:
            return conn.execute(
                sa.text("select count(*) from leases where reassigned_to is not null")
            ).scalar_one()
    finally:
        engine.dispose()


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "trainer" / "summary.json").read_text())


# the cheater starts after the honest worker, which asks for its next unit as soon as it
# submits and on a quiet machine took every unit of a 6-step run: room for the cheater's units
STEPS_WITH_CHEATER = 10


def test_swarm_trains_and_bans_the_cheater(tmp_path, cache_dir):
    config = _config(
        cache_dir,
        f"rl.steps={STEPS_WITH_CHEATER}",
        "swarm.workers=1",
        "swarm.cheaters=['corrupt_weights_after:1']",
    )
    run_dir = tmp_path / "run"
    facts = run_swarm(config, run_dir, display=False, timeout_s=300)

    cheater = load_keypair(run_dir / "keys" / "worker-1.key").node_id
    honest = load_keypair(run_dir / "keys" / "worker-0.key").node_id
    swarm = facts["swarm"]
    assert swarm["banned_nodes"] == [cheater]
    assert swarm["submissions"]["rejected"] >= 1
    assert swarm["submissions"]["rejected_honest"] == 0
    assert swarm["versions_published"] == STEPS_WITH_CHEATER + 1  # v0 + one per step
    assert facts["ledger"]["verified"] is True and facts["ledger"]["attested"] is True
    assert facts["status"] == "completed"
    assert facts["swarm"]["submissions"]["rejected_trained"] == 0
    assert (run_dir / "policy" / "config.json").is_file()  # the trainer's final policy
    told = summary_text(facts)
    assert "worker-1 cheated (corrupt_weights_after:1)" in told and "banned" in told
    assert f"swarmrl ledger verify {run_dir / 'ledger.jsonl'} --orchestrator-key" in told
    # validators judged with thresholds calibrated at run start, recorded in the run
    recorded = run_dir / "toploc-thresholds.json"
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["toploc"]["thresholds_path"] == str(recorded.resolve())
    thresholds = json.loads(recorded.read_text())["thresholds"]
    assert thresholds["max_mantissa_mean"] < 10.0 and thresholds["min_exponent_matches"] > 90
    summary = _summary(run_dir)
    history = summary["training"]["history"]
    assert [row["step"] for row in history] == list(range(STEPS_WITH_CHEATER))
    assert all(tuple(row) == ROW_KEYS for row in history)  # the keys of a colocated run
    # nothing the validator rejected or the ban dropped ever reached the trainer
    subs = _submissions(run_dir)
    consumed = summary["consumed_submissions"]
    assert consumed and len(consumed) == len(set(consumed))
    assert all(subs[s][1] == "trained" for s in consumed)
    assert any(subs[s][0] == honest for s in consumed)
    rejected = [s for s, (node, status, _) in subs.items() if status == "rejected"]
    assert rejected and all(subs[s][0] == cheater for s in rejected)


def test_swarm_survives_dead_worker_relay_and_orchestrator_restart(tmp_path, cache_dir):
    """Kill a worker holding a lease and the relay for good; kill -9 the validator and the
    orchestrator, which the supervisor starts again: the run ends, nothing accepted is lost."""
    # the faults are dealt as the trainer's steps are seen: roles report (and are watched) five
    # times a second, so a tiny model's quick steps cannot all pass between two looks
    config = _config(
        cache_dir,
        "rl.steps=10",
        "swarm.workers=2",
        "swarm.lease_timeout_s=3",
        "swarm.status_interval_s=0.2",
    )
    run_dir = tmp_path / "run"
    plan = prepare(config, run_dir)
    done: set[str] = set()
    seen_before_restart: dict[str, tuple[str, str, int | None]] = {}
    doomed = load_keypair(run_dir / "keys" / "worker-1.key").node_id

    with (
        LiveDisplay(enabled=False) as live,
        Supervisor(run_dir, 5, max_restarts=2, restart_backoff_s=0.5) as sup,
    ):
        start_all(sup, plan)

        def crash(name: str) -> None:  # kill -9, not retired: the supervisor's to restart
            os.killpg(sup.roles[name].pid, signal.SIGKILL)
            sup.roles[name].popen.wait(timeout=10)
            done.add(name)

        def faults(statuses) -> None:
            trainer = statuses.get("trainer")
            step = trainer.metrics.get("step", 0) if trainer else 0
            if "worker" not in done and step >= 1:
                # A machine vanishing while it holds a lease: kill the worker, then take one more
                # lease with its key, as if it had leased just before dying (its heartbeats have
                # stopped, so nobody will ever answer that lease). Deterministic, unlike waiting
                # to catch the live worker mid-lease.
                if "worker-killed" not in done:
                    sup.kill("worker-1")
                    done.add("worker-killed")
                doomed_key = load_keypair(plan.key("worker-1"))
                try:
                    with PoolClient(plan.orchestrator_url, doomed_key) as pc:
                        reply = pc.lease(POOL_ID)
                except PeerUnavailable:  # the orchestrator is between a crash and its restart
                    reply = None
                if (reply is not None and reply.work is not None) or _active_leases(
                    run_dir, doomed
                ) > 0:
                    done.add("worker")
            if "relay" not in done and step >= 1:
                sup.kill("relay-0")
                done.add("relay")
            if "validator-0" not in done and step >= 2:
                crash("validator-0")  # its claims come back to it when it returns
            # only once the orphaned lease exists: the lease above talks to the orchestrator
            if "orchestrator" not in done and "worker" in done and step >= 3:
                seen_before_restart.update(_submissions(run_dir))
                crash("orchestrator")

        watch(sup, plan, live, timeout_s=400, on_tick=faults)
        # the surviving worker keeps leasing after the last step; give the orphaned lease
        # (deadline lease_timeout_s after the kill) time to be handed to it
        wait_until(lambda: _reassigned(run_dir) >= 1, "the dead worker's lease to move", 30)
        facts = swarm_facts(plan)

    assert done >= {"worker", "relay", "orchestrator", "validator-0"}
    assert sup.roles["orchestrator"].restarts == 1 and sup.roles["validator-0"].restarts == 1
    summary = _summary(run_dir)
    assert [row["step"] for row in summary["training"]["history"]] == list(range(10))
    assert facts["ledger"]["verified"] is True
    assert facts["swarm"]["submissions"]["rejected"] == 0
    after = _submissions(run_dir)
    # accepted work survives the restart (accepted, in a batch a trainer holds — "leased" —
    # or trained); nothing is consumed twice
    kept = ("accepted", "leased", "trained")
    for sid, (_, status, _) in seen_before_restart.items():
        if status in kept:
            assert after[sid][1] in kept, (sid, status, after[sid])
    consumed = summary["consumed_submissions"]
    assert len(consumed) == len(set(consumed))
    assert _reassigned(run_dir) >= 1  # the dead worker's lease went to the survivor
    # the surviving worker kept getting versions after the relay died (origin fallback)
    survivor = json.loads((run_dir / "status" / "worker-0.json").read_text())
    assert survivor["policy_version"] >= 4


def test_roles_started_by_hand_stop_by_themselves_when_the_trainer_finishes(tmp_path, cache_dir):
    """The roles as an operator starts them (docs/deploy.md), with nobody to stop them: once
    the trainer finishes its last step it says so, the orchestrator answers leases with
    ``finished``, and the worker and the validator exit 0 on their own."""
    config = _config(cache_dir, "rl.steps=2", "swarm.workers=1")
    run_dir = tmp_path / "run"
    plan = prepare(config, run_dir)
    with Supervisor(run_dir, 5, max_restarts=0, restart_backoff_s=0.5) as sup:
        start_all(sup, plan)
        trainer = sup.roles["trainer"]
        wait_until(lambda: trainer.popen.poll() is not None, "the trainer to finish", 300)
        assert trainer.popen.returncode == 0
        for name in ("worker-0", "validator-0"):
            assert sup.roles[name].popen.wait(timeout=60) == 0, name
        with PoolClient(plan.orchestrator_url, load_keypair(plan.key("worker-0"))) as pool:
            assert pool.lease(POOL_ID).outcome == "finished"
    logs = run_dir / "logs"
    assert "told the orchestrator the run is finished" in (logs / "trainer.log").read_text()
    assert "the run is finished" in (logs / "worker-0.log").read_text()
    assert "the run is finished" in (logs / "validator-0.log").read_text()
