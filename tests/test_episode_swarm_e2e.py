"""A real swarm on multi-turn episodes: ``tool_arith`` with every role its own process, and a
worker that forges tool results after its first unit. It is caught by the validator's
recomputation of the environment's turns and banned; nothing it forged reaches the trainer.

Wiring, not learning (a short warm start, a few steps; the learning goal is the shipped
config's, see BENCHMARKS.md): online filtering is off so that a barely warm-started policy's
groups, all wrong, still make steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa

import swarmrl
from swarmrl.config import load_config
from swarmrl.identity import load_keypair
from swarmrl.launch.facts import summary_text
from swarmrl.launch.swarm import run_swarm
from swarmrl.pool.state.db import make_engine, sqlite_url

pytestmark = pytest.mark.slow
TOOL_ARITH = Path(swarmrl.__file__).resolve().parent / "configs" / "tool_arith.toml"

STEPS = 8
TINY = [
    "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128",
    "sft.steps=40", "sft.batch_size=64", "sft.train_examples=2000",
    f"rl.steps={STEPS}", "rl.prompts_per_step=4", "rl.group_size=4", "rl.online_filter=false",
    "rl.max_backfill_rounds=0", "eval.n=20", "eval.control=false", "eval.every=100",
    "swarm.rollouts_per_lease=8", "swarm.ready_timeout_s=120", "swarm.give_up_s=90",
    "swarm.batch_timeout_s=120", "swarm.shutdown_grace_s=5",
    "swarm.workers=1", "swarm.cheaters=['forge_env_after:1']",
    # every unit checked: what is tested is how a checked episode is judged, not the draw (a
    # forged unit the draw skips waits unreleased and the run may end before a check finds it)
    "swarm.spot_check_floor=1.0",
]  # fmt: skip


def _submissions(run_dir: Path) -> dict[str, tuple[str, str]]:
    """submission id → (node id, status) from the orchestrator's database."""
    engine = make_engine(sqlite_url(run_dir / "orchestrator" / "pool.db"))
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("select submission_id, node_id, status from submissions"))
            return {r[0]: (r[1], r[2]) for r in rows}
    finally:
        engine.dispose()


def test_a_worker_forging_tool_results_is_banned_and_none_of_its_forgeries_trains(tmp_path):
    config = load_config([TOOL_ARITH], [*TINY, f"run.cache_dir={tmp_path / 'cache'}"])
    run_dir = tmp_path / "run"
    facts = run_swarm(config, run_dir, display=False, timeout_s=400)

    cheater = load_keypair(run_dir / "keys" / "worker-1.key").node_id
    honest = load_keypair(run_dir / "keys" / "worker-0.key").node_id
    swarm = facts["swarm"]
    assert facts["status"] == "completed"
    assert swarm["banned_nodes"] == [cheater]
    (forger,) = [w for w in swarm["workers"] if w["node_id"] == cheater]
    assert forger["first_rejection"].split(": ")[1:3] == ["episode", "env_mismatch"], forger
    assert swarm["submissions"]["rejected_honest"] == 0
    assert swarm["submissions"]["rejected_trained"] == 0
    assert facts["ledger"]["verified"] is True
    assert "worker-1 cheated (forge_env_after:1)" in summary_text(facts)
    # the honest worker's episodes trained every step; the forger's unit with a forged turn
    # was rejected, and what else of it was not dropped with the ban held nothing forged
    summary = json.loads((run_dir / "trainer" / "summary.json").read_text())
    consumed = summary["consumed_submissions"]
    subs = _submissions(run_dir)
    assert consumed and all(subs[s][1] == "trained" for s in consumed)
    assert any(subs[s][0] == honest for s in consumed)
    by_cheater = [s for s, (node, _) in subs.items() if node == cheater]
    assert any(subs[s][1] == "rejected" for s in by_cheater)
    # a forger's unit may still train when none of its episodes had a turn to forge (answers
    # without a tool call): the trainer
    # recomputes every episode it trains, checked or not, and found no forged one
    assert summary["flow"]["forged"] == []
    assert [s for s, (_, status) in subs.items() if status == "rejected"] == [
        s for s in by_cheater if subs[s][1] == "rejected"
    ]
    history = summary["training"]["history"]
    assert [row["step"] for row in history] == list(range(STEPS))
