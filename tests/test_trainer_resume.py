"""A swarm whose trainer is SIGKILLed mid-run and restarted: it resumes from its checkpoint.

The run still finishes every step once, no version number is published twice, no accepted
submission is trained twice, and the ledger verifies. Every role is a real process.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from swarmrl.launch.display import LiveDisplay
from swarmrl.launch.facts import swarm_facts
from swarmrl.launch.plan import prepare
from swarmrl.launch.swarm import start_all, start_trainer, watch
from swarmrl.rolekit.supervisor import Supervisor
from test_swarm_e2e import _config, _summary, cache_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

# The kill must land mid-run: a tiny model's step can take 0.1 s on a quiet machine, so the run
# has room for it (steps 2 to STEPS - 3) and the roles report and are watched five times a second.
STEPS = 16


def _manifests(run_dir: Path) -> dict[str, bytes]:
    store = run_dir / "trainer" / "origin"
    return {p.parent.parent.name: p.read_bytes() for p in store.glob("v*/_shardcast/manifest.json")}


@pytest.mark.parametrize("nproc", [1, 2])
def test_killed_trainer_resumes_from_its_checkpoint(
    tmp_path: Path,
    cache_dir: Path,  # noqa: F811
    nproc: int,
) -> None:
    config = _config(
        cache_dir,
        f"rl.steps={STEPS}",
        "swarm.workers=1",
        "trainer.checkpoint_every=1",
        f"trainer.nproc={nproc}",
        "swarm.status_interval_s=0.2",
    )
    run_dir = tmp_path / "run"
    plan = prepare(config, run_dir)
    latest = run_dir / "trainer" / "checkpoints" / "latest"
    before_kill: dict[str, bytes] = {}

    with LiveDisplay(enabled=False) as live, Supervisor(run_dir, 5) as sup:
        start_all(sup, plan)

        def kill_once(statuses) -> None:
            trainer = statuses.get("trainer")
            step = trainer.metrics.get("step", 0) if trainer else 0
            # mid-run only: a trainer that already finished (or is about to) is not "killed"
            mid_run = 2 <= step <= STEPS - 3 and sup.roles["trainer"].alive()
            if not before_kill and mid_run and latest.is_file():
                before_kill.update(_manifests(run_dir))
                sup.stop("trainer", signal.SIGKILL)
                start_trainer(sup, plan)

        watch(sup, plan, live, timeout_s=900, on_tick=kill_once)
        facts = swarm_facts(plan)

    assert before_kill, "the trainer finished before it could be killed"
    summary = _summary(run_dir)
    history = summary["training"]["history"]
    assert [row["step"] for row in history] == list(range(STEPS))  # each step once
    versions = [row["policy_version"] for row in history]
    assert versions == sorted(set(versions))  # strictly increasing: none reused
    after = _manifests(run_dir)
    for version, manifest in before_kill.items():  # nothing published before was replaced
        if version in after:
            assert after[version] == manifest, version
    consumed = summary["consumed_submissions"]
    assert consumed and len(consumed) == len(set(consumed))
    assert facts["ledger"]["verified"] is True
    resumed = re.search(
        r"resumed from \S+: step (\d+)", (run_dir / "logs" / "trainer.log").read_text()
    )
    assert resumed, "the restarted trainer did not resume from a checkpoint"
    # the killed trainer is gone (ranks too): the restarted one has steps left to train
    assert int(resumed.group(1)) < STEPS
