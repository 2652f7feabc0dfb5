"""Every tool the README and docs name, run as a user types it on what ``swarmrl run`` wrote.

The session's short swarm run and short colocated run (``runs`` in conftest.py, the runs the
dashboard's tests use too) are the inputs: ``swarmrl ledger verify``, ``swarmrl report``,
``swarmrl eval`` and ``swarmrl serve`` each check what a user would check on them, so a tool
cannot pass on a fixture of its own and fail on a run. (``swarmrl dashboard`` on these runs:
tests/test_dashboard_runs.py; ``swarmrl serve`` on a colocated run: tests/test_serve.py.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from swarmrl.testing.serve import ServeProcess

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _swarmrl(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def test_ledger_verify_checks_every_entry_of_a_swarm_runs_ledger(runs):
    run = runs["swarm"]
    ledger = _report(run)["ledger"]
    assert ledger["entries"] > 0 and ledger["verified"]
    # the command report.json (and the run's last lines) tell the user to type
    done = _swarmrl(
        "ledger", "verify", ledger["file"], "--orchestrator-key", ledger["orchestrator_key"]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"OK: {ledger['entries']} entries" in done.stdout
    assert "head attested by the orchestrator" in done.stdout


def test_report_writes_a_swarm_runs_report_again_from_what_the_run_wrote(runs, tmp_path):
    run = runs["swarm"]
    copy = tmp_path / run.name
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("rollouts", "*-?"))
    for name in ("report.png", "metrics.jsonl"):
        (copy / name).unlink()
    done = _swarmrl("report", str(copy))
    assert done.returncode == 0, done.stderr
    before, again = _report(run), _report(copy)
    assert done.stdout.startswith(f"completed: {before['steps']} steps")
    assert again["status"] == "completed" and again["steps"] == before["steps"]
    assert again["eval"] == before["eval"]
    # without an orchestrator to ask, the pool's facts the run reported are kept
    assert again["ledger"] == before["ledger"] and again["swarm"] == before["swarm"]
    assert (copy / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()
    assert (copy / "report.png").stat().st_size > 0


def test_report_on_a_colocated_run_says_its_report_is_written_already(runs):
    done = _swarmrl("report", str(runs["colocated"]))
    assert done.returncode == 2
    assert "is a colocated run" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("mode", ["swarm", "colocated"])
def test_eval_of_a_runs_policy_gives_the_accuracy_its_report_gives(runs, mode):
    run = runs[mode]
    after = _report(run)["eval"]["after"]
    # the run's task and evaluation settings (conftest.SHORT); the model comes from policy/
    done = _swarmrl(
        "eval", "configs/arith.toml", "--model", str(run / "policy"),
        "--set", "env.digits=1", "--set", "eval.n=20",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["model"] == str(run / "policy")
    # greedy, on the same held-out tasks (a one-digit task has 10 of them, fewer than eval.n)
    assert result["n"] == after["n"] == 10
    assert result["accuracy"] == after["accuracy"]


def test_serve_answers_with_a_swarm_runs_policy(runs):
    run = runs["swarm"]
    with ServeProcess(run, "--threads", "1") as served:
        models = httpx.get(f"{served.url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [run.name]
        reply = httpx.post(
            f"{served.url}/v1/completions",
            json={"model": run.name, "prompt": "1+2=", "max_tokens": 3, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] is not None
