"""A ``swarmrl run`` whose trainer is SIGKILLed mid-run at the default settings (no checkpoints,
``trainer.checkpoint_every = 0``): the launcher's supervisor starts it again, the new trainer
publishes its starting weights under a version number nobody has seen and trains every step, and
the run completes with its learning report, no version reused, the ledger verified.

Every role is a real process; the kill comes from outside, by pid, as ``kill -9`` would.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from swarmrl.launch.swarm import run_swarm
from swarmrl.protocol.swarm import RoleStatus
from test_swarm_e2e import _config, _summary, cache_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

STEPS = 8


def _children_running(verb: str) -> list[int]:
    """Pids of this process's children that run ``swarmrl VERB``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and argv[2:4] == [b"swarmrl.cli", verb.encode()]:
            found.append(int(stat.parent.name))
    return found


def _manifests(run_dir: Path) -> dict[str, bytes]:
    store = run_dir / "trainer" / "origin"
    return {p.parent.parent.name: p.read_bytes() for p in store.glob("v*/_shardcast/manifest.json")}


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the trainer in /proc")
def test_a_trainer_killed_mid_run_without_checkpoints_is_restarted_and_the_run_completes(
    tmp_path: Path,
    cache_dir: Path,  # noqa: F811
) -> None:
    config = _config(
        cache_dir,
        f"rl.steps={STEPS}",
        "swarm.workers=1",
        "swarm.status_interval_s=0.2",
        "swarm.restart_backoff_s=0.2",
    )
    assert config.trainer.checkpoint_every == 0  # the default: nothing to resume from
    run_dir = tmp_path / "run"
    killed: dict[str, object] = {}
    done = threading.Event()

    def kill_mid_run() -> None:
        while not done.is_set():
            trainer = RoleStatus.read_dir(run_dir / "status").get("trainer")
            step = trainer.metrics.get("step", 0) if trainer else 0
            pids = _children_running("trainer")
            if 2 <= step <= STEPS - 3 and len(pids) == 1:
                killed["manifests"] = _manifests(run_dir)
                killed["step"] = step
                os.kill(pids[0], signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_mid_run, daemon=True)
    killer.start()
    try:
        report = run_swarm(config, run_dir, display=False, timeout_s=900)
    finally:
        done.set()
        killer.join()

    assert killed, "the trainer finished before it could be killed"
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "trainer exited with status -9; restart 1" in log
    assert "older than the current" not in log
    assert report["status"] == "completed"
    assert report["steps"] == STEPS and "after" in report["eval"]
    assert json.loads((run_dir / "report.json").read_text())["status"] == "completed"
    assert (run_dir / "report.png").is_file() and (run_dir / "policy" / "config.json").is_file()
    assert report["ledger"]["verified"] is True
    # the restarted trainer trained every step once, on versions after the killed one's
    history = _summary(run_dir)["training"]["history"]
    assert [row["step"] for row in history] == list(range(STEPS))
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == list(range(STEPS))
    before = {int(name[1:]) for name in killed["manifests"]}
    versions = [row["policy_version"] for row in history]
    assert versions == sorted(set(versions)) and versions[0] > max(before)
    # no version published twice: what was out before the kill is unchanged
    after = _manifests(run_dir)
    for name, manifest in killed["manifests"].items():
        if name in after:
            assert after[name] == manifest, name
    consumed = _summary(run_dir)["consumed_submissions"]
    assert consumed and len(consumed) == len(set(consumed))
