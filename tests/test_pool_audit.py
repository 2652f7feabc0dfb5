"""The orchestrator refuses to start on a database that disagrees with its ledger: a cut tail,
an emptied ledger, an unbanned node, inflated credits, a rejected unit turned accepted, a node's
evidence reset; and
what a node signed is kept, so anyone can re-check its signature."""

import shutil
import sqlite3
import subprocess
import sys

import pytest

from swarmrl.errors import CorruptData, LedgerMismatch
from swarmrl.identity import KeyPair
from swarmrl.pool.client import PoolClient
from swarmrl.pool.server import make_context
from swarmrl.pool.state.store import RolloutStore
from swarmrl.pool.trust.audit import check_node_signature
from swarmrl.protocol.pool import PoolSpec, SamplingParams, Submission
from swarmrl.protocol.verdicts import Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

POOL = "au"


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """A run directory with an accepted unit, a rejected one (its node banned) and credits."""
    tmp = tmp_path_factory.mktemp("audit")
    orch, owner, validator, good, bad = (KeyPair.generate() for _ in range(5))
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=20,
        open=True,
        sampling=SamplingParams(max_new_tokens=2),
        validators=[validator.public_key_hex],
    )
    with local_orchestrator(tmp / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        for key in (good, bad):
            node = PoolClient(server.url, key)
            node.join(POOL, CPU_NODE)
            work = node.lease(POOL).work
            node.submit(
                POOL, Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
            )
        checker = PoolClient(server.url, validator)
        for p in checker.claim(POOL):
            ok = p.node_id == good.node_id
            lp = [s.logprobs for s in p.samples] if ok else None
            v = Verdict(
                submission_id=p.submission_id,
                accept=ok,
                measured_tokens=2 if ok else 0,
                behaviour_logprobs=lp,
                evidence={"logprobs": 0.9} if ok else None,  # the node's record: S = 0.4
            )
            checker.verdict(POOL, v)
    return tmp / "run", orch


TAMPERING = {
    "cut tail": "DELETE FROM ledger WHERE seq = (SELECT MAX(seq) FROM ledger)",
    "emptied ledger": "DELETE FROM ledger",
    "unbanned node": "UPDATE nodes SET state = 'healthy', hard = 0 WHERE state = 'banned'",
    "credits x1000": "UPDATE credits SET tokens = tokens * 1000",
    "rejected made accepted": "UPDATE submissions SET status = 'accepted' WHERE status = 'rejected'",
    "edited ledger body": "UPDATE ledger SET body = replace(body, '\"tokens\":2', '\"tokens\":9')",
    "evidence reset": "UPDATE node_evidence SET value = 0, units = 0, total = 0",
    "evidence deleted": "DELETE FROM node_evidence",
}


def _tampered(history, tmp_path, sql):
    run, orch = history
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    with sqlite3.connect(copy / "pool.db") as conn:
        assert conn.execute(sql).rowcount > 0
    return copy, orch


def test_an_untouched_database_starts(history):
    run, orch = history
    make_context(orch, run).engine.dispose()


@pytest.mark.parametrize("case", sorted(TAMPERING))
def test_a_tampered_database_is_refused_at_start(history, tmp_path, case):
    run, orch = _tampered(history, tmp_path, TAMPERING[case])
    with pytest.raises(LedgerMismatch, match="refusing to start"):
        make_context(orch, run)


def test_the_orchestrator_command_says_so_in_one_line(history, tmp_path):
    run, orch = _tampered(history, tmp_path, TAMPERING["cut tail"])
    key_file = tmp_path / "orch.json"
    orch.save(key_file)
    cmd = [sys.executable, "-m", "swarmrl.cli", "orchestrator", "--key", str(key_file)]
    done = subprocess.run(
        cmd + ["--run-dir", str(run), "--port", "0"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]  # after the resolved-config log line
    assert "error: the pool database disagrees with its ledger" in last, done.stderr


def test_a_third_party_can_recheck_every_node_signature(tmp_path):
    orch, owner, node_key = (KeyPair.generate() for _ in range(3))
    spec = PoolSpec(
        pool_id=POOL,
        owner_key=owner.public_key_hex,
        task_count=20,
        open=True,
        sampling=SamplingParams(max_new_tokens=2),
        validated_fraction=0.0,
        max_leases_in_flight=16,
    )
    with local_orchestrator(tmp_path / "run", orch) as server:
        PoolClient(server.url, orch).create_pool(spec)
        node = PoolClient(server.url, node_key)
        node.join(POOL, CPU_NODE)
        for _ in range(10):
            work = node.lease(POOL).work
            node.submit(
                POOL, Submission(lease_id=work.lease_id, samples=synthetic_samples(work, 0))
            )
        entries = [e for e in PoolClient(server.url, orch).ledger() if e["kind"] == "submission"]
    # from the ledger and the rollout store alone, with nothing but the node's public key
    store = RolloutStore(str(tmp_path / "run" / "rollouts"))
    assert len(entries) == 10
    stored = [p.name for p in (tmp_path / "run" / "rollouts").rglob("*") if p.is_file()]
    assert len(stored) == 1 and stored[0].endswith(".seg")  # one segment, not a file each
    for entry in entries:
        assert entry["body"]["node_key"] == node_key.public_key_hex
        check_node_signature(store, POOL, entry["body"])
    first = entries[0]["body"]["submission_id"]
    store.put_request(f"{POOL}/{first}.parquet", b'{"lease_id": "forged", "samples": []}')
    with pytest.raises(CorruptData):
        check_node_signature(store, POOL, entries[0]["body"])
