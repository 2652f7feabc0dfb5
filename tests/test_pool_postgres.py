"""The pool and ledger on a real PostgreSQL server (the ``pg_url`` fixture of conftest.py)."""

import pytest

from swarmrl.cli import main as swarmrl_main
from swarmrl.config.pool import PoolConfig
from swarmrl.errors import NodeBanned
from swarmrl.identity import KeyPair
from swarmrl.ledger.verify import verify_export
from swarmrl.pool.client import PoolClient
from swarmrl.pool.invites import make_invite
from swarmrl.protocol import SamplingParams
from swarmrl.protocol.pool import PoolSpec, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples


def test_pool_cycle_restart_and_ledger_on_postgres(pg_url, tmp_path):
    orch, owner, validator = (KeyPair.generate() for _ in range(3))
    cfg = PoolConfig(db_url=pg_url, store_url=str(tmp_path / "store"))
    spec = PoolSpec(
        pool_id="pg",
        owner_key=owner.public_key_hex,
        task_count=30,
        samples_per_task=2,
        sampling=SamplingParams(max_new_tokens=3),
        validators=[validator.public_key_hex],
    )
    good, bad = KeyPair.generate(), KeyPair.generate()
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        PoolClient(server.url, orch).create_pool(spec)
        receipts = {}
        for key in (good, bad):
            client = PoolClient(server.url, key)
            client.join("pg", CPU_NODE, make_invite(owner, "pg", 60))
            work = client.lease("pg").work
            receipts[key.node_id] = client.submit(
                "pg", Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
            )
        checker = PoolClient(server.url, validator)
        pending = {p.node_id: p for p in checker.claim("pg")}
        ok = pending[good.node_id]
        checker.verdict(
            "pg",
            Verdict(
                submission_id=ok.submission_id,
                accept=True,
                measured_tokens=receipts[good.node_id].tokens,
                behaviour_logprobs=[s.logprobs for s in ok.samples],
            ),
        )
        checker.verdict(
            "pg",
            Verdict(
                submission_id=pending[bad.node_id].submission_id,
                accept=False,
                reasons=["sampling replay mismatch"],
                measured_tokens=0,
            ),
        )
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:  # restart on the same database
        admin = PoolClient(server.url, owner)
        states = {n.node_id: n.state for n in admin.nodes("pg")}
        assert states == {good.node_id: "healthy", bad.node_id: "banned"}
        with pytest.raises(NodeBanned):
            PoolClient(server.url, bad).lease("pg")
        batch = admin.batch("pg", step=0)
        assert [s.node_id for s in batch.submissions] == [good.node_id]
        assert admin.metrics("pg").credited_tokens == receipts[good.node_id].tokens
    out = tmp_path / "ledger.jsonl"
    assert swarmrl_main(["ledger", "export", "--db", pg_url, "--out", str(out)]) == 0
    report = verify_export(out, orch.public_key_hex)
    assert report.ok, report.reason
    assert report.contributions[good.node_id].net_tokens == receipts[good.node_id].tokens
    assert report.contributions[bad.node_id].banned
