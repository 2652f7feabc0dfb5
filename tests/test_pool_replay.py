"""Signed-request replay: nonces survive an orchestrator restart, and requests dated more than a
few seconds ahead are refused, on SQLite and PostgreSQL."""

import time

import httpx

from swarmrl.config.pool import PoolConfig
from swarmrl.identity import KeyPair
from swarmrl.identity.requests import sign_request
from swarmrl.pool.client import PoolClient
from swarmrl.protocol.pool import PoolSpec
from swarmrl.testing.pool_nodes import CPU_NODE, local_orchestrator

POOL = "rp"


def _send(url, path, headers, body):
    headers = headers | {"Content-Type": "application/json"}
    return httpx.post(url + path, content=body, headers=headers, timeout=30)


def test_a_request_captured_before_a_restart_is_refused_after_it(db_url, tmp_path):
    orch, owner, node = (KeyPair.generate() for _ in range(3))
    cfg = PoolConfig(db_url=db_url)
    spec = PoolSpec(
        pool_id=POOL, owner_key=owner.public_key_hex, task_count=10, open=True, validated_fraction=0
    )
    path, body = f"/pools/{POOL}/lease", b""
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        PoolClient(server.url, orch).create_pool(spec)
        PoolClient(server.url, node).join(POOL, CPU_NODE)
        # dated 4 s ahead (inside the accepted skew), so it is still fresh after the restart
        captured = sign_request(node, "POST", path, body, now_s=time.time() + 4)
        first = _send(server.url, path, captured, body)
        assert first.status_code == 200 and first.json()["work"] is not None
    with local_orchestrator(tmp_path / "run", orch, cfg) as server:
        replay = _send(server.url, path, captured, body)
        assert replay.status_code == 401, replay.text
        assert "already used" in replay.json()["error"]["message"]
        leases = PoolClient(server.url, owner).nodes(POOL)[0].leases_in_flight
        assert leases == 1  # the replay gave the node no lease it never asked for


def test_requests_dated_ahead_beyond_the_skew_are_refused(tmp_path):
    orch, owner, node = (KeyPair.generate() for _ in range(3))
    spec = PoolSpec(
        pool_id=POOL, owner_key=owner.public_key_hex, task_count=10, open=True, validated_fraction=0
    )
    path, body = f"/pools/{POOL}/heartbeat", b'{"status":"ok"}'
    with local_orchestrator(tmp_path / "run", orch, PoolConfig()) as server:
        PoolClient(server.url, orch).create_pool(spec)
        PoolClient(server.url, node).join(POOL, CPU_NODE)
        ahead = _send(
            server.url, path, sign_request(node, "POST", path, body, now_s=time.time() + 45), body
        )
        assert ahead.status_code == 401 and "window" in ahead.json()["error"]["message"], ahead.text
        near = _send(
            server.url, path, sign_request(node, "POST", path, body, now_s=time.time() + 2), body
        )
        assert near.status_code == 200, near.text
        old = _send(
            server.url, path, sign_request(node, "POST", path, body, now_s=time.time() - 45), body
        )
        assert old.status_code == 200, old.text


def test_the_database_nonce_store_refuses_reuse_until_expiry(db_url, tmp_path):
    from swarmrl.pool.db import make_engine, sqlite_url
    from swarmrl.pool.nonces import DatabaseNonceStore

    engine = make_engine(db_url or sqlite_url(tmp_path / "n.db"))
    now = [1000.0]
    store = DatabaseNonceStore(engine, clock=lambda: now[0])
    key, other = "a" * 64, "b" * 64
    assert store.claim(key, "n" * 16, expires_at_s=1060.0)
    assert not store.claim(key, "n" * 16, expires_at_s=1060.0)
    assert store.claim(other, "n" * 16, expires_at_s=1060.0)  # per key
    now[0] = 1061.0  # expired: the window check alone refuses it now, so it may be forgotten
    assert store.claim(key, "n" * 16, expires_at_s=1121.0)
    assert not DatabaseNonceStore(engine, clock=lambda: now[0]).claim(key, "n" * 16, 1121.0)
    engine.dispose()
