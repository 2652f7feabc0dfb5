"""Assignments are unpredictable to a node until it holds the lease, and verifiable afterwards:
the orchestrator's per-epoch secret is committed in the ledger before use and revealed after."""

import sqlalchemy as sa

from swarmrl.cli import main as swarmrl_main
from swarmrl.identity import KeyPair
from swarmrl.identity.keys import digest_hex
from swarmrl.ledger.chain import Ledger, ledger_metadata
from swarmrl.ledger.export import read_entries
from swarmrl.ledger.verify import export_lines, verify_export, verify_lines
from swarmrl.pool.client import PoolClient
from swarmrl.pool.flow.scheduling import draw_tasks, unit_seed
from swarmrl.pool.state.db import sqlite_url
from swarmrl.protocol.pool import PoolSpec, SamplingParams
from swarmrl.protocol.seeds import derive_seed
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator

POOL = "as"
TASKS = 1000


def public_prediction(node_id: str, n: int) -> list[int]:
    """What a node could compute before joining if draws used public inputs only."""
    return [derive_seed("task", 7, node_id, 0, i) % TASKS for i in range(n)]


def test_ground_keys_cannot_predict_tasks_and_the_reveal_verifies(tmp_path):
    orch, owner = KeyPair.generate(), KeyPair.generate()
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=TASKS,
        open=True,
        seed=7,
        sampling=SamplingParams(max_new_tokens=2),
        validated_fraction=0.0,
        min_tasks_per_lease=4,
        max_tasks_per_lease=4,
    )
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        # a grinder tries 32 keys and keeps the one whose (public) first draw looks easiest
        keys = [KeyPair.generate() for _ in range(32)]
        best = min(keys, key=lambda k: public_prediction(k.node_id, 4))
        units = {}
        for key in [best, *[k for k in keys if k is not best][:7]]:
            node = PoolClient(server.url, key)
            node.join(POOL, CPU_NODE)
            units[key.node_id] = node.lease(POOL).work
        for node_id, work in units.items():
            assert work.task_indices != public_prediction(node_id, 4)
        # before the reveal, the ledger holds only a digest of the secret
        head = PoolClient(server.url, orch).ledger_head(1000)
        commits = [e for e in head if e["kind"] == "assignment_commit"]
        assert [c["body"]["epoch"] for c in commits] == [0]
        assert not any(e["kind"] == "assignment_reveal" for e in head)
        PoolClient(server.url, owner).set_version(POOL, 1)  # the epoch closes
        head = PoolClient(server.url, orch).ledger_head(1000)
    [reveal] = [e for e in head if e["kind"] == "assignment_reveal"]
    secret = reveal["body"]["secret"]
    assert digest_hex(secret.encode()) == commits[0]["body"]["commitment"]
    for node_id, work in units.items():
        assert work.assignment_epoch == 0
        assert work.task_indices == draw_tasks(7, secret, node_id, 0, 4, TASKS)
        assert work.seed == unit_seed(7, secret, node_id, 0)
    out = tmp_path / "ledger.jsonl"
    db_url = sqlite_url(tmp_path / "run" / "pool.db")
    assert swarmrl_main(["ledger", "export", "--db", db_url, "--out", str(out)]) == 0
    assert verify_export(out, orch.public_key_hex).ok


def test_a_reveal_that_does_not_match_its_commitment_fails_verification():
    orch = KeyPair.generate()
    engine = sa.create_engine("sqlite://")
    ledger_metadata.create_all(engine)
    with engine.begin() as conn:
        ledger = Ledger(orch)
        ledger.append(
            conn, "assignment_commit", {"epoch": 0, "commitment": digest_hex(b"aa")}, pool_id=POOL
        )
        ledger.append(conn, "assignment_reveal", {"epoch": 0, "secret": "bb"}, pool_id=POOL)
    report = verify_lines(export_lines(read_entries(engine, 100)), orch.public_key_hex)
    assert (
        not report.ok and "commitment" in report.reason and report.first_bad.startswith("entry 1")
    )
