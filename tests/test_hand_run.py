"""A swarm deployed by hand (docs/deploy.md: each role started with its own command) gets the
run directory ``swarmrl run`` writes: the trainer writes report.json (with the pool's closing
account), report.png, metrics.jsonl and ledger.jsonl, and logs its SFT control; ``swarmrl
report RUN_DIR --orchestrator URL --key OWNER_KEY`` writes them again after the fact.

The roles are started as an operator would type them; only the addresses are loopback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from swarmrl.config import EMBEDDED_DEFAULT, load_config
from swarmrl.config.load import read_toml
from swarmrl.launch.facts import POOL_ID
from swarmrl.launch.plan import HOST, prepare
from swarmrl.launch.swarm import (
    start_orchestrator,
    start_validator,
    start_worker,
    wait_for_version_0,
)
from swarmrl.rolekit.supervisor import Supervisor, wait_until

pytestmark = pytest.mark.slow

RUN = {
    "env": {"digits": 1},
    "model": {"tiny": {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64}},
    "sft": {"steps": 4, "batch_size": 16},
    "rl": {"steps": 2, "prompts_per_step": 2, "group_size": 2},
    "eval": {"n": 4, "control": True},
    "swarm": {"workers": 1, "validators": 1, "relays": 0, "shutdown_grace_s": 5.0},
}


def _run_toml(tmp_path: Path) -> Path:
    data = read_toml(EMBEDDED_DEFAULT)
    for section, values in RUN.items():
        data.setdefault(section, {}).update(values)
    data["run"]["cache_dir"] = str(tmp_path / "cache")
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def _report(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", "report", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_trainer_started_by_hand_writes_the_run_directory_swarmrl_run_writes(tmp_path):
    config = load_config([_run_toml(tmp_path)])
    run_dir = tmp_path / "run"
    plan = prepare(config, run_dir)  # keys, invites, pool.json: docs/deploy.md steps 1-2
    with Supervisor(run_dir, 5) as sup:
        start_orchestrator(sup, plan)
        # the page's trainer command, as typed (no --no-report: that is the launcher's)
        trainer_args = [
            str(plan.config_file),
            "--key", str(plan.key("trainer")),
            "--orchestrator", plan.orchestrator_url,
            "--pool", POOL_ID,
            "--run-dir", str(run_dir),
            "--origin-host", HOST,
            "--origin-port", str(plan.origin_port),
            "--status-dir", str(plan.status_dir),
        ]  # fmt: skip
        trainer = sup.start_role("trainer", "trainer", trainer_args)
        for name in plan.validators:
            start_validator(sup, plan, name)
        for name in plan.workers:
            start_worker(sup, plan, name)
        wait_for_version_0(sup, plan)
        # a role that fails leaves the trainer waiting for rollouts: stop at once, with its log
        # (workers and validators leave with 0 once the run is finished, before the trainer)

        def failed() -> dict[str, str]:
            return {
                name: role.log_tail()
                for name, role in sup.roles.items()
                if name != "trainer" and role.popen.poll() not in (None, 0)
            }

        wait_until(lambda: not trainer.alive() or failed(), "the trainer to finish its run", 400)
        assert not failed(), f"a role failed before the trainer ended: {failed()}"
        assert trainer.popen.returncode == 0, trainer.log_tail()

        report = json.loads((run_dir / "report.json").read_text())
        assert report["status"] == "completed" and report["mode"] == "swarm"
        assert report["steps"] == 2
        ev = report["eval"]
        for arm in ("before", "after", "control"):
            assert ev[arm]["accuracy"] is not None, arm
        # the control's time is the RL's less the waits for the pool
        assert 0 <= ev["control"]["budget_s"] < report["rl_seconds"]
        assert report["ledger"]["verified"] and report["ledger"]["entries"] > 0
        assert report["swarm"]["submissions"]["trained"] > 0
        assert [w["name"] for w in report["swarm"]["workers"]] == plan.workers
        assert (run_dir / "report.png").stat().st_size > 0
        assert (run_dir / "ledger.jsonl").is_file()
        rows = (run_dir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows] == [0, 1]
        log = trainer.log_path.read_text()
        assert "control: the warm start's SFT continued for" in log
        assert "control done:" in log
        assert "the ledger (" in log  # the closing account swarmrl run prints

        # after the fact, from the trainer's files and the orchestrator (still up)
        for name in ("report.json", "report.png", "metrics.jsonl", "ledger.jsonl"):
            (run_dir / name).unlink()
        done = _report(
            str(run_dir), "--orchestrator", plan.orchestrator_url, "--key", str(plan.key("trainer"))
        )
        assert done.returncode == 0, done.stderr
        again = json.loads((run_dir / "report.json").read_text())
        assert again["status"] == "completed" and again["steps"] == 2
        assert again["eval"] == report["eval"]
        assert again["ledger"]["verified"]
        assert again["ledger"]["entries"] >= report["ledger"]["entries"]
        assert again["swarm"]["submissions"]["trained"] == report["swarm"]["submissions"]["trained"]
        assert (run_dir / "report.png").stat().st_size > 0
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
        assert "the ledger (" in done.stdout


def test_report_without_the_trainers_summary_says_what_run_dir_is(tmp_path):
    done = _report(str(tmp_path))
    assert done.returncode == 2
    assert "trainer/summary.json not found" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_report_asks_for_the_owner_key_to_ask_the_orchestrator(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "summary.json").write_text('{"status": "running", "training": {}}')
    done = _report(str(tmp_path), "--orchestrator", "http://127.0.0.1:9")
    assert done.returncode == 2
    assert "--orchestrator needs --key" in done.stderr


def _row(step: int) -> dict:
    from swarmrl.trainer.loop import ROW_KEYS

    return {key: 0.0 for key in ROW_KEYS} | {"step": step, "policy_version": step}


def test_a_trainer_restarted_by_hand_keeps_the_steps_before_its_restart_and_says_why_it_failed(
    tmp_path,
):
    """The restarted trainer's loop holds only the steps since its checkpoint; metrics.jsonl
    and report.json still hold every step, and a failed end records the reason even when the
    orchestrator is gone."""
    import argparse

    from swarmrl.errors import WaitTimeout
    from swarmrl.identity import KeyPair
    from swarmrl.launch.handrun import HandRunReport
    from swarmrl.trainer.loop import TrainingResult

    key = tmp_path / "trainer.key"
    KeyPair.generate().save(key)
    config = load_config([EMBEDDED_DEFAULT], ["swarm.peer_timeout_s=2", "swarm.retry_s=0.1"])
    args = argparse.Namespace(
        run_dir=str(tmp_path / "run"),
        pool=POOL_ID,
        orchestrator="http://127.0.0.1:9",  # nothing listens there
        key=str(key),
        status_dir=None,
    )
    report = HandRunReport(config, args)
    history = [_row(0), _row(1)]  # step 0 before the restart, step 1 after
    report.follow(TrainingResult(steps=2, history=[history[1]]), history)
    report.step(history[1])
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [0, 1]
    report.end("failed", WaitTimeout("no rollouts came in 600 s"))
    written = json.loads((tmp_path / "run" / "report.json").read_text())
    assert written["status"] == "failed"
    assert written["reason"] == "WaitTimeout: no rollouts came in 600 s"
    assert written["steps"] == 2
    assert (tmp_path / "run" / "report.png").stat().st_size > 0
