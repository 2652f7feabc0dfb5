"""A verifiers 0.4 taskset in a run: ``swarmrl run CONFIG --colocated`` plays its harness
episodes with the trainer's engine and trains on them (``swarmrl.trainer.harness``); a swarm
refuses it in one line unless ``env.verifiers_reexecute`` declares the harness deterministic,
and then runs it on untrusted workers, its validators playing the harness again with each
episode's model turns: a worker running a tampered harness is banned and nothing of it trains.
The taskset, its harness and the policy are the tests' own (``swarmrl.testing.vf1``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

vf = pytest.importorskip("verifiers", reason="verifiers is not installed")
if Version(vf.__version__) < Version("0.4"):
    pytest.skip(f"verifiers {vf.__version__} is installed, not >=0.4", allow_module_level=True)

from swarmrl.testing.vf1 import write_run  # noqa: E402


def _run(config: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", "run", str(config), *extra, "--quiet"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_a_colocated_run_trains_on_harness_episodes(tmp_path: Path):
    config, env = write_run(tmp_path)
    result = _run(config, env, "--colocated")
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "loss" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for row in steps:
        # 2 tasks × 2 episodes (the harness asks "sure?" between two model calls)
        assert row["groups_kept"] == 2 and row["tokens"] > 0, row
        assert 0.0 <= row["reward_mean"] < 1.0
    # the taskset's dense reward (some digits in a random reply) differs within a group: the
    # policy gets a real update
    assert any(r["reward_mean"] > 0 for r in steps)
    assert any(r["grad_norm"] > 0 for r in steps)
    report = json.loads((run_dir / "report.json").read_text())
    evaluation = report["eval"]
    for when in ("before", "after"):
        assert evaluation[when]["n"] == 2
        # the harness's episodes, whole: two model turns each
        assert evaluation[when]["mean_turns"] == 2.0, evaluation[when]
    assert (run_dir / "policy" / "config.json").is_file()


def test_a_swarm_refuses_a_verifiers_taskset_in_one_line(tmp_path: Path):
    config, env = write_run(tmp_path)
    result = _run(config, env)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "verifiers_reexecute" in lines[0], result.stderr[-2000:]
    assert "--colocated" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_a_swarm_replays_the_harness_and_bans_a_worker_running_a_tampered_one(tmp_path: Path):
    config, env = write_run(tmp_path, steps=4, eval_every=100)  # held-out: before and after
    sets = [
        "env.verifiers_reexecute=true", "swarm.workers=1", "swarm.cheaters=['forge_env_after:0']",
        "swarm.rollouts_per_lease=2",  # units of one task: the forger submits several
        "swarm.spot_check_floor=1.0",  # every unit checked: the judgement is what is tested
    ]  # fmt: skip
    result = _run(config, env, *[x for s in sets for x in ("--set", s)])
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    facts = json.loads((run_dir / "report.json").read_text())
    swarm = facts["swarm"]
    (forger,) = [w for w in swarm["workers"] if w.get("cheat")]
    assert swarm["banned_nodes"] == [forger["node_id"]]
    # the forger's "sure?!" (from its first unit) is not what the harness asks: call 1's prompt
    assert "env_mismatch: call 1's prompt differs" in forger["first_rejection"], forger
    assert swarm["submissions"]["rejected_honest"] == 0
    assert swarm["submissions"]["rejected_trained"] == 0
    assert swarm["submissions"]["trained"] > 0
    assert facts["ledger"]["verified"] is True


def test_a_harness_that_fails_stops_the_run_with_its_one_line(tmp_path: Path):
    config, env = write_run(tmp_path, steps=1)
    config.write_text(config.read_text().replace('mode = "check"', 'mode = "crash"'))
    result = _run(config, env, "--colocated")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("swarmrl run: HarnessFailed: verifiers task"), result.stderr[-2000:]
    assert "exited 3: harness: out of cheese" in last
