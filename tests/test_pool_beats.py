"""Heartbeats written in batches (swarmrl.pool.trust.beats): a beat that keeps a node's state waits for
the flush, one that changes it is written at once, a flush never undoes a ban, and a crash loses
at most the beats of the last flush period while a replayed beat stays refused."""

import json
import os
import signal
import time

import httpx
import pytest
import sqlalchemy as sa

from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.pool.flow import work
from swarmrl.pool.server import make_context
from swarmrl.pool.state import db
from swarmrl.pool.trust import joins, penalties, service
from swarmrl.protocol.pool import Heartbeat, JoinRequest, PoolSpec
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator, spawn_orchestrator

POOL = "beats"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool(db_url, tmp_path):
    """A context over a fresh pool with one joined node, on a clock the test moves."""
    orch, owner, node = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    ctx = make_context(orch, tmp_path / "run", PoolConfig(db_url=db_url))
    clock = Clock()
    ctx.clock, ctx.started_at = clock, clock.now - 1000
    spec = PoolSpec(
        pool_id=POOL, owner_key=owner.public_key_hex, task_count=10, open=True, validated_fraction=0
    )
    service.create_pool(ctx, spec)
    joins.join(ctx, POOL, node.public_key_hex, node.node_id, JoinRequest(metadata=CPU_NODE))
    yield ctx, clock, node.node_id
    ctx.engine.dispose()


def _row(ctx, node_id):
    with ctx.engine.connect() as conn:
        return service.node_row(conn, POOL, node_id)


def test_a_beat_that_keeps_the_state_waits_for_the_flush(pool):
    ctx, clock, node = pool
    joined = _row(ctx, node).last_beat_at
    clock.now += 3
    service.heartbeat(ctx, POOL, node, Heartbeat(status="ok", model_version=0, log_tail=["a"]))
    clock.now += 3
    reply = service.heartbeat(
        ctx, POOL, node, Heartbeat(status="degraded", tokens_per_s=7.0, log_tail=["b", "c"])
    )
    assert reply.state == "healthy"
    before = _row(ctx, node)
    assert before.last_beat_at == joined and json.loads(before.log_tail) == []
    assert service.flush_beats(ctx) == 1
    after = _row(ctx, node)
    assert after.last_beat_at == clock.now and after.status == "degraded"
    assert after.reported_tps == 7.0 and after.model_version is None  # the later beat's values
    assert json.loads(after.log_tail) == ["a", "b", "c"]  # every line of both beats
    assert service.flush_beats(ctx) == 0


def test_a_beat_that_changes_the_state_is_written_at_once(pool):
    ctx, clock, node = pool
    service.heartbeat(ctx, POOL, node, Heartbeat(status="ok", log_tail=["buffered"]))
    clock.now += ctx.config.dead_after_s + 1
    service.sweep(ctx)
    assert _row(ctx, node).state == "dead"
    clock.now += 1
    reply = service.heartbeat(ctx, POOL, node, Heartbeat(status="ok", log_tail=["back"]))
    assert reply.state == "healthy"
    row = _row(ctx, node)  # no flush: the revival is in the database already
    assert row.state == "healthy" and row.last_beat_at == clock.now
    assert json.loads(row.log_tail) == ["buffered", "back"]
    assert len(ctx.beats) == 0
    assert work.lease(ctx, POOL, node).outcome == "work"  # at once, as before batching
    service.heartbeat(ctx, POOL, node, Heartbeat(status="error"))
    assert _row(ctx, node).state == "unhealthy"  # and the other way


def test_a_flush_does_not_undo_a_ban(pool):
    ctx, clock, node = pool
    clock.now += 2
    service.heartbeat(ctx, POOL, node, Heartbeat(status="ok", log_tail=["before the ban"]))
    penalties.invalidate(ctx, POOL, node, "hard", "caught cheating", None)
    assert service.flush_beats(ctx) == 1
    row = _row(ctx, node)
    assert row.state == "banned"
    with ctx.engine.connect() as conn:
        states = conn.execute(sa.select(db.nodes.c.state)).scalars().all()
    assert states == ["banned"]


@pytest.mark.slow
def test_a_crash_loses_at_most_the_last_flush_and_replays_stay_refused(tmp_path):
    orch, node = KeyPair.generate(), KeyPair.generate()
    key_file, spec_file = tmp_path / "orch.json", tmp_path / "spec.json"
    orch.save(key_file)
    spec = PoolSpec(
        pool_id=POOL, owner_key=orch.public_key_hex, task_count=10, open=True, validated_fraction=0
    )
    spec_file.write_text(spec.model_dump_json())
    settings = {"pool.heartbeat_flush_s": 0.2}
    path = f"/pools/{POOL}/heartbeat"
    body = Heartbeat(status="ok", log_tail=["flushed"]).model_dump_json().encode()
    proc, url = spawn_orchestrator(tmp_path / "run", key_file, [spec_file], settings=settings)
    try:
        PoolClient(url, node).join(POOL, CPU_NODE)
        # dated ahead (inside the accepted skew), so it is still fresh after the restart
        captured = sign_request(node, "POST", path, body, now_s=time.time() + 4)
        captured |= {"Content-Type": "application/json"}
        assert httpx.post(url + path, content=body, headers=captured).status_code == 200
        time.sleep(1.0)  # several flush periods
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no clean stop: whatever was buffered is lost
        proc.wait(timeout=30)
    proc, url = spawn_orchestrator(tmp_path / "run", key_file, [spec_file], settings=settings)
    try:
        assert PoolClient(url, orch).node_logs(POOL, node.node_id).lines == ["flushed"]
        replay = httpx.post(url + path, content=body, headers=captured)
        assert replay.status_code == 401, replay.text
        assert replay.json()["error"]["code"] == "replayed_request"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_beat_claims_its_nonce_in_its_own_transaction_and_a_replay_is_refused(db_url, tmp_path):
    """The hot lane claims a beat's nonce with the beat: a replay is refused, a refused beat
    (an unknown node) keeps its nonce used, and the FastAPI route (a query string sends the
    request there) claims it once, as before."""
    orch, node, stranger = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    cfg = PoolConfig(db_url=db_url)
    spec = PoolSpec(
        pool_id=POOL, owner_key=orch.public_key_hex, task_count=10, open=True, validated_fraction=0
    )
    path = f"/pools/{POOL}/heartbeat"
    body = Heartbeat(status="ok").model_dump_json().encode()

    def send(url, key, target=path):
        headers = sign_request(key, "POST", target, body) | {"Content-Type": "application/json"}
        return headers, httpx.post(url + target, content=body, headers=headers)

    def replay(url, headers, target=path):
        return httpx.post(url + target, content=body, headers=headers)

    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        PoolClient(server.url, orch).create_pool(spec)
        PoolClient(server.url, node).join(POOL, CPU_NODE)
        headers, first = send(server.url, node)
        assert first.status_code == 200 and first.json()["state"] == "healthy"
        again = replay(server.url, headers)
        assert again.status_code == 401 and again.json()["error"]["code"] == "replayed_request"
        headers, unknown = send(server.url, stranger)
        assert unknown.status_code == 404
        again = replay(server.url, headers)
        assert again.status_code == 401 and again.json()["error"]["code"] == "replayed_request"
        slow_lane = path + "?via=fastapi"
        headers, first = send(server.url, node, slow_lane)
        assert first.status_code == 200, first.text
        again = replay(server.url, headers, slow_lane)
        assert again.status_code == 401 and again.json()["error"]["code"] == "replayed_request"


def test_a_nonce_claimed_in_a_transaction_is_refused_until_expiry(db_url, tmp_path):
    from swarmrl.errors import ReplayedRequest
    from swarmrl.identity.keys import PublicKey
    from swarmrl.identity.requests import SignedRequest
    from swarmrl.pool.state.db import make_engine, sqlite_url
    from swarmrl.pool.state.nonces import DatabaseNonceStore, claim_in

    engine = make_engine(db_url or sqlite_url(tmp_path / "n.db"))
    now = [1000.0]
    store = DatabaseNonceStore(engine, clock=lambda: now[0], purge_every_s=1e9)

    def who(key: str, expires_at: float) -> SignedRequest:
        return SignedRequest(PublicKey(key), "n", 0, "n" * 16, "s", "d", b"", expires_at, False)

    def claim(key: str, expires_at: float) -> bool:
        try:
            with engine.begin() as conn:
                claim_in(store, who(key, expires_at), conn)
            return True
        except ReplayedRequest:
            return False

    key, other = "a" * 64, "b" * 64
    assert claim(key, 1060.0)
    assert not claim(key, 1060.0)
    assert not store.claim(key, "n" * 16, 1060.0)  # one table for both ways of claiming
    assert claim(other, 1060.0)  # per key
    now[0] = 1061.0  # expired and not yet purged: reused once
    assert claim(key, 1121.0)
    assert not claim(key, 1121.0)
    engine.dispose()


def test_a_database_made_before_lease_task_counts_gets_them(tmp_path):
    """An orchestrator started on a database without ``leases.n_tasks`` adds the column and
    counts the tasks of the leases in flight (admission sums them)."""
    from swarmrl.pool.state.db import make_engine, sqlite_url

    url = sqlite_url(tmp_path / "old.db")
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE leases DROP COLUMN n_tasks"))
        for lease_id, state, tasks in (("a", "active", [3, 5, 8]), ("b", "submitted", [1])):
            conn.execute(
                sa.text(
                    "INSERT INTO leases (lease_id, pool_id, node_id, state, work, created_at, "
                    "deadline) VALUES (:i, 'p', 'n', :s, :w, 0, 1)"
                ),
                {"i": lease_id, "s": state, "w": json.dumps({"task_indices": tasks})},
            )
    engine.dispose()
    engine = make_engine(url)
    with engine.connect() as conn:
        counts = dict(conn.execute(sa.select(db.leases.c.lease_id, db.leases.c.n_tasks)).all())
    assert counts == {"a": 3, "b": 0}
    engine.dispose()
