"""A run directory you can trust: report.json and metrics.jsonl follow the run, and Ctrl-C
leaves a report (status ``interrupted``) with everything already finished.

Each test starts a real ``swarmrl run`` process, waits until the run has reached a given
point (read from its own run directory), sends SIGINT as a terminal's Ctrl-C would, and reads
what was left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from swarmrl.launch.report import read_metrics

pytestmark = pytest.mark.slow

COLOCATED = [
    'env.name="reverse"',
    "env.reverse_len=3",
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=64",
    "sft.steps=10",
    "sft.train_examples=64",
    "sft.batch_size=32",
    "rl.steps=60",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "rl.online_filter=false",
    "rl.sampling.max_new_tokens=5",
    "eval.n=64",
    "eval.samples=2",
    "eval.every=0",
    "eval.control=true",  # the control lasts as long as the RL (60 steps: ~2 s here)
    "run.threads=1",
]


def _start(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    config = tmp_path / "empty.toml"
    config.write_text("")
    overrides = [f"run.cache_dir={json.dumps(str(tmp_path / 'cache'))}"]
    overrides.append(f"run.run_dir={json.dumps(str(tmp_path / 'runs'))}")
    sets = [x for o in overrides for x in ("--set", o)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "swarmrl.cli", "run", str(config), "--quiet", *args, *sets],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )


def _report(tmp_path: Path) -> tuple[Path, dict] | None:
    runs = sorted((tmp_path / "runs").glob("*/report.json"))
    if not runs:
        return None
    try:
        return runs[0].parent, json.loads(runs[0].read_text())
    except ValueError:
        return None


def _interrupt_when(
    proc: subprocess.Popen[bytes], tmp_path: Path, ready: Callable[[Path, dict], bool]
) -> tuple[Path, dict, str]:
    """SIGINT ``proc`` once ``ready(run_dir, report)`` holds; its run dir, final report, output."""
    deadline = time.monotonic() + 400
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "the run never reached the point to interrupt"
            found = _report(tmp_path)
            if found is not None and ready(*found):
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out.decode()
    found = _report(tmp_path)
    assert found is not None
    return found[0], found[1], out.decode()


def _in_control(run_dir: Path, report: dict) -> bool:
    return "after" in report.get("eval", {}) and any((run_dir / "policy").glob("*.safetensors"))


def test_an_error_raised_while_an_interrupt_unwinds_ends_the_run_as_interrupted(
    tmp_path, monkeypatch
):
    """Ctrl-C landing inside a library whose clean-up then fails (torch's function-mode stack
    under ``from_pretrained``: "trying to pop from empty mode stack", seen in the test below)
    still ends the run as interrupted (exit status 130), its report written as such."""
    import swarmrl.trainer.colocated as colocated
    from swarmrl.cli import main
    from swarmrl.config import EMBEDDED_DEFAULT
    from swarmrl.errors import interrupted

    def run(config, hooks, on_sft_step=None):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("trying to pop from empty mode stack") from None

    try:
        run(None, None)
    except RuntimeError as exc:
        assert interrupted(exc)  # the interrupt is its context, though not its cause
    assert not interrupted(RuntimeError("plain")) and not interrupted(None)
    monkeypatch.setattr(colocated, "run_colocated", run)
    args = ["--colocated", "--quiet", "--set", f"run.run_dir={tmp_path}"]
    status = main(["run", str(EMBEDDED_DEFAULT), *args])
    assert status == 130
    (report,) = tmp_path.glob("*/report.json")
    assert json.loads(report.read_text())["status"] == "interrupted"


def test_colocated_run_interrupted_in_its_control_keeps_report_metrics_and_policy(tmp_path):
    sets = [x for o in COLOCATED for x in ("--set", o)]
    proc = _start(tmp_path, "--colocated", *sets)
    run_dir, report, out = _interrupt_when(proc, tmp_path, _in_control)
    assert report["status"] == "interrupted", out
    assert report["mode"] == "colocated"
    assert report["steps"] == 60
    assert {"before", "after"} <= set(report["eval"]), report["eval"]
    if "control" not in report["eval"]:  # the interrupt came before the control's eval ended
        assert "ended before the control" in report["eval"]["control_skipped"]
    assert 0.0 <= report["eval"]["after"]["accuracy"] <= 1.0
    assert [row["step"] for row in read_metrics(run_dir)] == list(range(60))
    assert (run_dir / "policy" / "config.json").is_file()
    assert (run_dir / "report.png").is_file()
    assert "interrupted" in out


SWARM = [
    "env.digits=1",
    "model.tiny.hidden_size=64",
    "model.tiny.num_layers=2",
    "model.tiny.intermediate_size=128",
    "sft.steps=60",
    "sft.batch_size=64",
    "rl.steps=200",
    "rl.prompts_per_step=2",
    "rl.group_size=4",
    "rl.max_backfill_rounds=0",
    "eval.n=10",
    "eval.every=0",
    "eval.control=false",
    "swarm.workers=1",
    "swarm.validators=1",
    "swarm.relays=0",
    "swarm.rollouts_per_lease=8",
    "swarm.ready_timeout_s=120",
    "swarm.give_up_s=90",
    "swarm.batch_timeout_s=120",
    "swarm.shutdown_grace_s=5",
]


def test_swarm_run_interrupted_mid_rl_reports_what_the_trainer_finished(tmp_path):
    sets = [x for o in SWARM for x in ("--set", o)]
    proc = _start(tmp_path, *sets)
    run_dir, report, out = _interrupt_when(
        proc, tmp_path, lambda _, r: r.get("status") == "running" and r.get("steps", 0) >= 2
    )
    assert report["status"] == "interrupted", out
    assert report["mode"] == "swarm"
    assert 2 <= report["steps"] < 200
    assert "before" in report["eval"] and "after" not in report["eval"]
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(report["steps"]))
    summary = json.loads((run_dir / "trainer" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    # the pool's facts were still collected: the orchestrator outlived the trainer
    assert report["ledger"]["verified"] is True
    statuses = [json.loads(p.read_text()) for p in (run_dir / "status").glob("*.json")]
    assert statuses and all(s["state"] != "banned" for s in statuses)
