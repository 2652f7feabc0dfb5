"""The pool and ledger on a real PostgreSQL server (started by .ci/services).

The server URL comes from SWARMRL_TEST_PG_URL or the file .ci/pg.env that .ci/services writes;
without either, the fixture runs ``.ci/services --no-install`` once. Skipped, with the reason,
only when no server can be started. Each test gets a fresh database, dropped afterwards.
"""

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from swarmrl.cli import main as swarmrl_main
from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.ledger.verify import verify_export
from swarmrl.pool.client import PoolClient, RequestRefused
from swarmrl.pool.invites import make_invite
from swarmrl.protocol.pool import PoolSpec, SamplingParams, Submission, Verdict
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, synthetic_samples

REPO = Path(__file__).resolve().parent.parent
ENV_FILE = REPO / ".ci" / "pg.env"


def _url_from_file() -> str | None:
    if not ENV_FILE.is_file():
        return None
    for line in ENV_FILE.read_text().splitlines():
        if line.startswith("SWARMRL_TEST_PG_URL="):
            return line.split("=", 1)[1].strip()
    return None


def _server_url() -> tuple[str | None, str]:
    url = os.environ.get("SWARMRL_TEST_PG_URL") or _url_from_file()
    if url:
        return url, ""
    services = REPO / ".ci" / "services"
    if not services.is_file():
        return None, "no SWARMRL_TEST_PG_URL and no .ci/services to start PostgreSQL"
    try:
        run = subprocess.run(
            [str(services), "--no-install"], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return None, ".ci/services did not start PostgreSQL within 120 s"
    return _url_from_file(), run.stderr.strip() or "PostgreSQL could not be started"


@pytest.fixture(scope="module")
def pg_url():
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[test]')")
    base, why = _server_url()
    if base is None:
        pytest.skip(f"no PostgreSQL server: {why}")
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    name = f"swarmrl_t_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
    except sa.exc.OperationalError as exc:
        pytest.skip(f"PostgreSQL at {base} is not reachable: {exc.orig}")
    url = base.rsplit("/", 1)[0] + "/" + name
    yield url
    with admin.connect() as conn:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    admin.dispose()


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
        with pytest.raises(RequestRefused, match="banned"):
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
